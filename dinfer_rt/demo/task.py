"""The embedded model's task: letters -> (any permutation) | sorted # reversed.

Prompt: ten distinct lower-case letters followed by ``=``. Answer (32 characters, then EOS): any
permutation of the ten letters, ``|``, the letters sorted, ``#``, the prompt reversed.
The permutation part has many valid answers whose positions depend on each other
(a letter used once cannot appear again), so committing every position at once fails
while the sorted and reversed parts are deterministic: exactly the trade-off the
diffusion scheduler's confidence rules manage. ``check`` accepts any valid answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LETTERS = "abcdefghijklmnopqrstuvwxyz"
N_LETTERS = 10
ANSWER_TOKENS = 3 * N_LETTERS + 3  # perm | sorted # reversed (32 characters), then EOS
HELDOUT_SEED = 20261130
HELDOUT_SIZE = 1000


@dataclass(frozen=True)
class Item:
    """One task instance: the letters, and one reference answer."""

    letters: str

    @property
    def prompt(self) -> str:
        return self.letters + "="

    def answer(self, rng: random.Random | None = None) -> str:
        """A valid answer; with ``rng`` the permutation part is shuffled (training targets)."""
        perm = list(self.letters)
        if rng is not None:
            rng.shuffle(perm)
        return "".join(perm) + "|" + "".join(sorted(self.letters)) + "#" + self.letters[::-1]


def random_item(rng: random.Random) -> Item:
    return Item("".join(rng.sample(LETTERS, N_LETTERS)))


def check(letters: str, answer: str) -> bool:
    """Exact-match check that accepts any permutation in the first part."""
    letters = letters.removesuffix("=")
    parts = answer.split("|")
    if len(parts) != 2:
        return False
    perm, rest = parts
    if sorted(perm) != sorted(letters) or len(perm) != len(letters):
        return False
    return rest == "".join(sorted(letters)) + "#" + letters[::-1]


def heldout(n: int = HELDOUT_SIZE) -> list[Item]:
    """The held-out set, regenerated deterministically from a fixed seed."""
    if not 0 < n <= HELDOUT_SIZE:
        raise ValueError(f"held-out slice size must be in 1..{HELDOUT_SIZE}, got {n}")
    rng = random.Random(HELDOUT_SEED)
    items: list[Item] = []
    seen: set[str] = set()
    while len(items) < HELDOUT_SIZE:
        item = random_item(rng)
        if item.letters not in seen:
            seen.add(item.letters)
            items.append(item)
    return items[:n]
