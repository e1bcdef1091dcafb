"""The inline guard: moderate a chat app's prompts and replies from the hidden states its own
model computes while it generates (no second forward pass). See :mod:`worker.guard.guard`."""

from worker.guard.guard import Guard, GuardedReply

__all__ = ["Guard", "GuardedReply"]
