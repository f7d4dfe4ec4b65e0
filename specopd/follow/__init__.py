"""A drafter that follows a moving policy (SpecOPD inside an RL loop): ``DrafterFollower`` (the Python API, also a
Ray actor) and ``specopd follow`` (``specopd.follow.job``). Design: specopd/follow/DESIGN.md."""
from specopd.follow.follower import DrafterFollower  # noqa: F401
