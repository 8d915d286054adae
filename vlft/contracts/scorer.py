"""What a scorer plugin answers (``vlft_scorers``): one way of scoring answers against their references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vlft.contracts import contract
from vlft.contracts.objective import Reward
from vlft.errors import ConfigError


@contract
@dataclass(frozen=True)
class Scorer:
    """What ``vlft_scorers()`` answers: one way of scoring answers against their references (``--scorer NAME``
    on ``vlft run`` and ``vlft eval``), which is also a reward (``--reward NAME``): one function seen twice.

    ``score(predictions, references, **context) -> list[float]``: one finite number per prediction, higher
    better (the reward GRPO adds up; 1 - CER for character error rate). ``figures(predictions, references,
    values, **context) -> {figure: value}``: what the evaluation reports for the set (a corpus BLEU, an IoU and
    its accuracy at 0.5, per-field accuracy and F1 as ``{field: {"accuracy": ..., "f1": ...}}``); None: ``{name:
    the mean of values}``. ``fits(references, **context) -> str``: why ``--scorer auto`` picks it for these
    references ('' when it does not; None: auto never picks it). ``context`` holds ``where`` (each record's
    ``file:line``) and, in evaluation, ``records`` (the records: their prompts and images) and
    ``box_coordinates`` (the model family's grounding convention), and may grow: accept ``**context`` and read
    what is there. A reference the scorer cannot read should raise: the chosen scorers run on every reference
    before any weight is loaded, and a record one raises on is reported as ``file:line``."""

    name: str
    description: str
    score: Callable[..., list] = field(compare=False)
    figures: Callable[..., dict] | None = field(default=None, compare=False)
    fits: Callable[..., str] | None = field(default=None, compare=False)
    lower_is_better: tuple[str, ...] = ()  # figures where less is better (the character error rate)

    def as_reward(self) -> Reward:
        """The scorer as a reward function (``--reward NAME``, no argument)."""

        def build(argument):
            if argument is not None:
                raise ConfigError(f"--reward {self.name}={argument}: the {self.name} scorer takes no argument")
            return self.score

        return Reward(self.name, self.description + " (a scorer: vlft eval --scorer " + self.name + ")", build)
