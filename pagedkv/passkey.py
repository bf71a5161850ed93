"""Passkey retrieval prompts: a number hidden at some depth in filler text, asked for at the end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about it.\n")
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyTrial:
    length: int
    depth: float
    prompt_ids: torch.Tensor  # [n] the prompt; with the answer, at most `length` tokens
    answer_ids: torch.Tensor  # [m] the pass key's tokens


def passkey_trial(tokenizer, length: int, depth: float, seed: int) -> PasskeyTrial:
    """A prompt that, with its answer, fits in `length` tokens; a 5-digit pass key at `depth` (0 = start,
    1 = end) of the filler."""
    rng = torch.Generator().manual_seed(seed)
    passkey = str(int(torch.randint(10000, 100000, (1,), generator=rng)))
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    answer = tokenizer(" " + passkey, add_special_tokens=False, return_tensors="pt").input_ids[0]
    budget = length - answer.shape[0]

    def prompt_ids(reps: int) -> torch.Tensor:
        before = round(reps * depth)
        text = PASSKEY_INTRO + FILLER * before + needle + FILLER * (reps - before) + PASSKEY_QUESTION
        return tokenizer(text, return_tensors="pt").input_ids[0]

    unit = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    reps = max(1, (budget - prompt_ids(0).shape[0]) // unit + 1)
    prompt = prompt_ids(reps)
    while prompt.shape[0] > budget and reps > 1:
        reps -= 1
        prompt = prompt_ids(reps)
    return PasskeyTrial(length, depth, prompt, answer)
