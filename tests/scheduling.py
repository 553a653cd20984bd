"""How `pytest -n 2 --dist loadfile` (the Makefile's) shares the test files between its two workers.

A test file goes whole to one worker, so a module fixture (a pipeline, a merged model, a Hub server) is built once.
Files that share a costly session fixture go to the same worker as one unit, so it is built once too (a session
fixture is per worker). The slowest units start first: on two workers the run ends when the last unit does, and a
long unit started late would leave the other worker idle. Files are named here by their base name, whichever folder
of tests/ holds them (the names are unique across the folders).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import PurePath

# Files that must share a worker, by what they share.
GROUPS = {
    # the torch venv and the wheel (installed into fresh venvs), the demo Hub, tests/artifacts/install.json
    "venvs": ("test_install.py", "test_space_deployed.py", "test_packaging.py", "test_keymaps.py"),
    # the verl-style training checkpoints (two gloo processes)
    "training": ("test_training.py", "test_verify_tensors.py"),
}
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}

# The slowest units, slowest first (per-file times of a full run on two workers; `pytest --durations=0` shows
# them); the rest follow in collection order. A file missing here only starts later than it could.
SLOWEST = (
    "test_gguf.py",
    "test_hub_pipeline.py",
    "venvs",
    "test_app_jobs.py",
    "test_community_families.py",
    "test_batch.py",
    "test_verify_diffusion.py",
    "training",
    "test_hub_streaming.py",
    "test_verify.py",
    "test_app_browser.py",
    "test_verify_formula.py",
    "test_quiet.py",
    "test_verify_text_encoders.py",
    "test_smollm2.py",
    "test_interrupted.py",
    "test_community_sd.py",
    "test_convert.py",
    "test_gguf_lora.py",
    "test_gguf_stream.py",
    "test_qlora.py",
    "test_hub_server.py",
    "test_convert_hub.py",
    "test_false_alarms.py",
    "test_fuzz.py",
    "test_verify_unavailable.py",
    "test_training_layouts.py",
)


def unit_of(nodeid: str) -> str:
    """The unit a test belongs to: its file's group, or its file."""
    file = nodeid.split("::", 1)[0]
    return GROUP_OF.get(PurePath(file).name, file)


def rank(unit: str) -> int:
    name = PurePath(unit).name
    return SLOWEST.index(name) if name in SLOWEST else len(SLOWEST)


def make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with our units, handed out slowest first."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # stable: units of equal rank keep their collection order
            self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda item: rank(item[0])))
            super()._assign_work_unit(node)

    return FileGroupScheduling(config, log)
