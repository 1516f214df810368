"""A recorder of which parts of a model are on the device while a stage of the pipeline runs.

On a machine without an accelerator, the CPU under another name (`OTHER_DEVICE`) stands in for one: tensors sent
there stay ordinary CPU tensors, so the recorder follows `Module.to` instead, part by part (each decoder layer, the
embedding, the final norm, the head). It notes what was on the device whenever a stage of the `Run` it gives
begins or ends and whenever a decoder layer runs, and how often each part arrived there.
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from casp_core.model import decoder_layers
from casp_core.run import Run, StageTimer

OTHER_DEVICE = torch.device("cpu", 0)


@dataclass(frozen=True)
class Snapshot:
    event: str  # "begin", "end" (of `stage`) or "run" (decoder layer `layer` ran)
    stage: str | None  # the innermost stage of the run, None outside any
    layer: int | None
    on_device: frozenset[str]

    def layers(self) -> set[str]:
        return {part for part in self.on_device if part.startswith("layer ")}


class _RecordingTimer(StageTimer):
    def __init__(self, placement: "DevicePlacement") -> None:
        super().__init__()
        self.placement = placement

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.placement.stages.append(name)
        self.placement.note("begin")
        try:
            with super().stage(name):
                yield
        finally:
            self.placement.note("end")
            self.placement.stages.pop()


class DevicePlacement:
    """Which parts of `model` `Module.to` has sent to `device`, noted at every stage boundary and layer run."""

    def __init__(self, model: nn.Module, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
        self.device = device
        self.parts: dict[str, nn.Module] = {f"layer {i}": layer for i, layer in enumerate(decoder_layers(model))}
        self.parts |= {"embedding": model.model.embed_tokens, "norm": model.model.norm, "head": model.lm_head}
        self.on_device: set[str] = set()
        self.arrivals: Counter[str] = Counter()  # times each part came to the device from the host
        self.stages: list[str] = []
        self.snapshots: list[Snapshot] = []
        for index, layer in enumerate(decoder_layers(model)):
            # After the layer has run: the first layer's input is captured by a hook that stops it before it runs.
            layer.register_forward_hook(lambda _module, _args, _output, index=index: self.note("run", index))
        move = nn.Module.to

        def recorded_move(module: nn.Module, *args, **kwargs) -> nn.Module:
            target = torch._C._nn._parse_to(*args, **kwargs)[0]
            if target is not None:  # else a change of dtype only
                self.moved(module, torch.device(target))
            return move(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, "to", recorded_move)

    def run(self) -> Run:
        """A Run whose stages are noted."""
        return Run(timer=_RecordingTimer(self))

    def moved(self, module: nn.Module, target: torch.device) -> None:
        for name, part in self.parts.items():
            if any(inner is part for inner in module.modules()):
                if target == self.device and name not in self.on_device:
                    self.arrivals[name] += 1
                (self.on_device.add if target == self.device else self.on_device.discard)(name)

    def note(self, event: str, layer: int | None = None) -> None:
        stage = self.stages[-1] if self.stages else None
        self.snapshots.append(Snapshot(event, stage, layer, frozenset(self.on_device)))

    @property
    def runs(self) -> list[int]:
        return [snapshot.layer for snapshot in self.snapshots if snapshot.event == "run"]

    def stages_with_runs(self) -> set[str | None]:
        return {snapshot.stage for snapshot in self.snapshots if snapshot.event == "run"}

    def offload_violations(self) -> list[str]:
        """Every moment one decoder layer at a time was not kept: two layers on the device, a layer running with
        anything else there (verification compares float64 copies: nothing of the model itself is there), a
        stage beginning or ending with the embedding, norm or head there, or anything left at the end."""
        found = []
        for snapshot in self.snapshots:
            layer = "" if snapshot.layer is None else f" layer {snapshot.layer}"
            where = f"{snapshot.event} {snapshot.stage}{layer}"
            if len(snapshot.layers()) > 1:
                found.append(f"{where}: {sorted(snapshot.on_device)} on the device")
            elif snapshot.event == "run":
                expected = set() if snapshot.stage == "verification" else {f"layer {snapshot.layer}"}
                if snapshot.on_device != expected:
                    found.append(f"{where}: {sorted(snapshot.on_device) or 'nothing'} on the device")
            elif snapshot.on_device - snapshot.layers():
                found.append(f"{where}: {sorted(snapshot.on_device)} on the device")
        if self.on_device:
            found.append(f"the end: {sorted(self.on_device)} left on the device")
        return found
