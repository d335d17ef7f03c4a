"""gemlite's autotune choices for the suite's shapes: recorded on a GPU, loaded before the
suite's first gemlite call on a GPU of the same architecture.

Why: gemlite (0.6) autotunes its kernels once per key (activation-row bucket, N, K, group
size, packing, dtype), benchmarking every config of its "fast" list, unless its config
cache holds the key. It ships such caches for common GPUs and model shapes
(``gemlite/configs/h100.json``, loaded at import), but the suite's shapes (64 x 128 layers,
lm_head widths at K 64, every rows route) are not in them, so a cold run on an H200 spent
556 s of its 1135 s of worker time autotuning gemlite (``--durations``, 2026-11-26). Autotune
also picks by measured time, so two runs could run a key on different configs with different
rounding; a recorded choice keeps each verdict to the same kernel, run after run.

So the suite records what gemlite's autotune chose for every key a default run reaches
(``--qconform-record-gemlite-configs=FILE``, ``nox -s gemlite-configs``, run on a GPU with
gemlite's packaged cache cleared so that every key is tuned there) and loads the file with
gemlite's own ``load_config``, as gemlite loads its packaged one. A key not in the file is
autotuned as before; a GPU of another architecture loads nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

RECORDED = Path(__file__).with_name("gemlite_configs_sm90.json")
RECORDED_CAPABILITY = (9, 0)  # the architecture RECORDED was tuned on (sm90: H100, H200)
_PART_SUFFIX = ".part"
_loaded: bool | None = None  # None: not decided yet in this process


def load_recorded(device: torch.device) -> bool:
    """Load RECORDED into gemlite's config cache, once per process, if ``device`` is a GPU of
    RECORDED_CAPABILITY and no recording is under way. Whether it is loaded."""
    global _loaded
    if _loaded is None:
        _loaded = (
            device.type == "cuda"
            and torch.version.hip is None
            and torch.cuda.get_device_capability(device) == RECORDED_CAPABILITY
            and RECORDED.is_file()
        )
        if _loaded:
            import gemlite

            _loaded = bool(gemlite.load_config(str(RECORDED)))
    return _loaded


def _write(path: Path) -> None:
    """What gemlite's autotune chose in this process, in gemlite's cache format."""
    import gemlite

    gemlite.cache_config(str(path))


def merge(path: Path, parts: list[Path]) -> None:
    """Merge the worker files ``parts`` into ``path`` (gemlite's format: kernel -> key ->
    config) and delete them. Keys are sorted, so a re-recording diffs readably."""
    merged: dict[str, dict[str, Any]] = {}
    for part in sorted(parts):
        try:
            data = json.loads(part.read_text())
        except (OSError, ValueError) as exc:
            raise pytest.UsageError(f"--qconform-record-gemlite-configs: cannot read {part}: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise pytest.UsageError(f"--qconform-record-gemlite-configs: {part} is not gemlite's config format")
        for kernel, configs in data.items():
            merged.setdefault(kernel, {}).update(configs)
    body = {kernel: dict(sorted(configs.items())) for kernel, configs in sorted(merged.items()) if configs}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    for part in parts:
        part.unlink()


class Recording:
    """``--qconform-record-gemlite-configs=FILE``: clears gemlite's packaged cache in each
    process (so every key the run reaches is autotuned on this GPU) and writes the choices:
    each pytest-xdist worker to a part file next to FILE, merged into FILE by the controller;
    a single process straight to FILE."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.path, self.worker = path, getattr(config, "workerinput", {}).get("workerid")
        self.controller = self.worker is None and bool(config.getoption("numprocesses", None))

    def start(self) -> None:
        global _loaded
        if self.controller:
            for stale in self._parts():  # left by an interrupted recording
                stale.unlink()
            return
        try:
            import gemlite
        except Exception as exc:  # noqa: BLE001 - gemlite asks Triton for a GPU driver on import
            raise pytest.UsageError(
                f"--qconform-record-gemlite-configs needs gemlite on a CUDA GPU; importing it failed: {exc}"
            ) from None
        gemlite.GemLiteLinear.reset_config()
        _loaded = False  # record what autotune chooses, not what a file says

    def _parts(self) -> list[Path]:
        return list(self.path.parent.glob(f"{self.path.name}.*{_PART_SUFFIX}"))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.worker is not None:
            _write(self.path.with_name(f"{self.path.name}.{self.worker}{_PART_SUFFIX}"))
        elif self.controller:
            merge(self.path, self._parts())
        else:
            part = self.path.with_name(f"{self.path.name}.main{_PART_SUFFIX}")
            _write(part)
            merge(self.path, [part])


def start_recording(config: pytest.Config) -> None:
    """Register the recording when the option is given."""
    target = config.getoption("qconform_record_gemlite_configs")
    if not target:
        return
    path = Path(os.path.abspath(target))
    if not path.parent.is_dir():
        raise pytest.UsageError(f"--qconform-record-gemlite-configs: folder {path.parent} does not exist")
    recording = Recording(config, path)
    recording.start()
    config.pluginmanager.register(recording, "qconform-gemlite-recording")
