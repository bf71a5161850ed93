"""Turning new tokens into text as they come, and finding stop strings in it.

Text is decoded over a short window of tokens (the few before the new ones give the tokenizer its
context, e.g. leading spaces), and emitted only once it no longer ends in an incomplete character.
While streaming, the last `len(longest stop string) - 1` characters are held back, so text already
sent never has to be taken back when a stop string completes.
"""

from __future__ import annotations

from .sequence import Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for the tokenizer's context


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, seq: Sequence) -> str | None:
        """Decode `seq`'s newest tokens into `seq.text`; return the stop string found in it, if any."""
        if self.tokenizer is None:
            return None
        if seq.detok_state is None:
            start = max(0, seq.num_prompt_tokens - CONTEXT_TOKENS)
            seq.detok_state = (start, seq.num_prompt_tokens)
        prefix_offset, read_offset = seq.detok_state
        ids = seq.token_ids
        prefix_text = self._decode(ids[prefix_offset:read_offset])
        full_text = self._decode(ids[prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        old_len = len(seq.text)
        seq.text += full_text[len(prefix_text):]
        seq.detok_state = (read_offset, len(ids))
        return self._find_stop(seq, old_len)

    def finalize(self, seq: Sequence) -> None:
        """The whole output's text, for a request that was not detokenized step by step."""
        if self.tokenizer is not None and seq.detok_state is None:
            seq.text = self._decode(seq.output_token_ids)
            self._find_stop(seq, 0)

    def _find_stop(self, seq: Sequence, old_len: int) -> str | None:
        stops = seq.params.stop
        if not stops:
            return None
        longest = max(len(s) for s in stops)
        search_from = max(0, old_len - longest + 1)
        found, at = None, None
        for stop in stops:
            i = seq.text.find(stop, search_from)
            if i >= 0 and (at is None or i < at):
                found, at = stop, i
        if found is not None:
            seq.text = seq.text[:at]
        return found

    @staticmethod
    def visible_text(seq: Sequence) -> str:
        """What may be shown now: all of it once finished, else all but a possible stop-string start."""
        stops = seq.params.stop
        if seq.is_finished or not stops:
            return seq.text
        hold = max(len(s) for s in stops) - 1
        return seq.text[:len(seq.text) - hold] if hold else seq.text
