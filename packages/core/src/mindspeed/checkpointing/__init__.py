"""Checkpoint reliability shared by the suites: discovery of the newest complete checkpoint,
rotation, preemption (SIGTERM / Ctrl-C / time limit), writers that never outlive their trainer,
and the fault points the reliability tests use. See ``docs/reliability.md``.
"""

from mindspeed.checkpointing.discovery import (
                                               ITER,
                                               MARKER,
                                               STEP,
                                               TRACKER,
                                               Layout,
                                               ResumePoint,
                                               checkpoint_dir,
                                               damage_of,
                                               find_resume,
                                               holds_checkpoints,
                                               is_complete,
                                               list_complete,
                                               list_step_dirs,
                                               remove_tree,
                                               rotate,
                                               step_of,
                                               tracker_step,
                                               write_marker,
                                               write_tracker,
)
from mindspeed.checkpointing.faults import FAULT_ENV, fault_point
from mindspeed.checkpointing.orphans import die_with_parent, forked_children_die_with_me
from mindspeed.checkpointing.preemption import (
                                               EXIT_SIGINT,
                                               EXIT_SIGTERM,
                                               LAUNCHER_INTERRUPT,
                                               Preemption,
                                               StopRequest,
                                               interrupts_come_from_launcher,
                                               resume_hint,
)

__all__ = ["EXIT_SIGINT", "EXIT_SIGTERM", "FAULT_ENV", "ITER", "LAUNCHER_INTERRUPT", "MARKER", "STEP", "TRACKER",
           "Layout", "Preemption",
           "ResumePoint", "StopRequest", "checkpoint_dir", "damage_of", "die_with_parent", "fault_point",
           "find_resume", "forked_children_die_with_me", "holds_checkpoints", "interrupts_come_from_launcher",
           "is_complete", "list_complete", "list_step_dirs", "remove_tree", "resume_hint", "rotate", "step_of",
           "tracker_step", "write_marker", "write_tracker"]
