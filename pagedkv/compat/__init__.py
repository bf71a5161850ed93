"""Other projects' names for pagedkv's API (`pagedkv.compat.mtplx`: the MTPLX seed)."""
