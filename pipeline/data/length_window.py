"""The rule that ``data.length_window`` must fit the batching: shared by the loader (ShardStream) and RunConfig,
kept here, below both."""
from __future__ import annotations


def length_window_problem(length_window: int, *, pack: bool, max_tokens: int | None, micro_batch_size: int,
                          context_length: int | None = None) -> str | None:
    """Why ``length_window`` does not fit the batching (None if it does): the loader (ShardStream) and RunConfig
    share this rule; callers prefix the field name."""
    if length_window < 0:
        return f"must be >= 0 (0 = off), got {length_window}"
    if not length_window:
        return None
    if pack:
        return ("cannot be combined with data.pack: packed rows are already full (set data.length_window: 0 or "
                "data.pack: false)")
    if not max_tokens and length_window % micro_batch_size:
        return (f"{length_window} is not a multiple of train.micro_batch_size {micro_batch_size}: every window would "
                "end with a short microbatch")
    fewest = max_tokens // context_length if max_tokens and context_length else 2
    if max_tokens and length_window < fewest:
        return (f"{length_window} < {fewest}, the rows of one full microbatch of train.max_tokens_per_microbatch "
                f"{max_tokens}" + (f" at data.context_length {context_length}" if context_length else ""))
    return None
