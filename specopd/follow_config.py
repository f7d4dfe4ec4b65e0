"""The recipe's ``follow:`` section (``FollowConfig``): ``specopd follow`` and ``specopd.follow.DrafterFollower``. A
leaf beside them (imports only ``specopd.settings``), so the recipe root can import it without the job."""
from __future__ import annotations

from dataclasses import dataclass

from specopd.settings import FROM_HERE, REFUSE, SAME_RUN, RecipeError, check_range, setting


@dataclass
class FollowConfig:
    """A drafter that follows a moving policy (an RL run): where the policy versions and their rollouts appear,
    and the training budget per version."""
    policies: str = setting("", resume=SAME_RUN)
    """``specopd follow``: the folder an RL trainer saves its policy versions in, one Hugging Face folder each, named
    with its version number last (``v3``, ``step-30``, ``global_step_30``); a folder is a version once complete
    (specopd/follow/DESIGN.md, "A complete policy folder")."""
    rollouts: str = setting("", resume=REFUSE)
    """``specopd follow``: where the rollouts are appended: one JSONL file, or a folder of ``*.jsonl`` files (read in
    name order); a record per line with ``policy_version``, in the prepared-data format or as a conversation. A
    line without its newline yet is not read."""
    steps_per_version: int = setting(20, resume=FROM_HERE)
    """Training steps per policy version (0: by seconds_per_version alone)."""
    seconds_per_version: float = setting(0.0, resume=FROM_HERE)
    """Training seconds per policy version (0: by steps_per_version alone; both set: whichever ends first)."""
    min_rollouts: int = setting(8, resume=FROM_HERE)
    """A version trains once this many of its rollouts arrived, or once a newer policy version is complete (then
    on what arrived). Rollouts of a version that arrive after it trained are counted as late, not trained on."""
    complete_marker: str = setting("", resume=SAME_RUN)
    """A file name that must also exist in a policy folder before it is a version (e.g. an RL trainer's own
    "done" marker); empty: the weights' completeness alone decides."""
    poll_s: float = setting(2.0, resume=SAME_RUN)
    """Seconds between looks at the policies and rollouts."""
    stop_at_version: int = setting(-1, resume=SAME_RUN)
    """``specopd follow`` exits once this version's drafter is published (-1: runs until stopped)."""
    idle_exit_s: float = setting(0.0, resume=SAME_RUN)
    """``specopd follow`` exits after this many seconds with no new policy version or rollout (0: never)."""
    vllm_server: str = setting("", resume=SAME_RUN)
    """The vLLM OpenAI server that drafts with the exports (e.g. http://localhost:8000): each publication prints
    how that server picks the new drafter up."""

    def __post_init__(self):
        check_range("follow", "steps_per_version", self.steps_per_version, lo=0)
        check_range("follow", "seconds_per_version", self.seconds_per_version, lo=0)
        if self.steps_per_version == 0 and self.seconds_per_version == 0:
            raise RecipeError("follow.steps_per_version=0 and follow.seconds_per_version=0: give a budget per policy "
                              "version (e.g. follow.steps_per_version=20)")
        check_range("follow", "min_rollouts", self.min_rollouts, lo=1)
        check_range("follow", "poll_s", self.poll_s, lo=0, lo_open=True)
        check_range("follow", "stop_at_version", self.stop_at_version, lo=-1)
        check_range("follow", "idle_exit_s", self.idle_exit_s, lo=0)
        if "/" in self.complete_marker or self.complete_marker in (".", ".."):
            raise RecipeError(f"follow.complete_marker={self.complete_marker!r} must be a file name inside the policy "
                              f"folder, not a path")
