"""A job's settings checked against the model's config once, before any weight loads: the API's pre-flight, the
command line's and the job's own are each one call to `plan_job`, so all three refuse the same settings with the
same message.

What it checks needs the settings and the model's config alone (a model of that config is built on the meta
device, without weights): that the family takes the settings (casp_core.families: the export, the settings a
family is not pruned with, a uniform shape its own class cannot hold), that whole heads and channels within r_max
reach the ratio (casp_core.method.budget, at the rounding the export asks for), that the widths take the
quantization (casp_core.artifacts.compressed_tensors.quantize), that recovery's windows fit the model's context,
and for a budget that some candidate meets it by the sizes estimated from the config.

Checked where they run, because they need more than the config:
- the tokenizer llama.cpp must reproduce for a GGUF export, and the rounding's warnings (casp_core.job.steps,
  once the weights are loaded);
- the device's memory, for pruning and for recovery (casp_core.method.placement);
- a GGUF source's header (casp_core.artifacts.gguf.source, when the file is read) and the data sets' presence.
"""

from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from casp_core.artifacts.compressed_tensors.quantize import check_quantization
from casp_core.families import check_export, family_of
from casp_core.job.stages import Stage, job_stages
from casp_core.job.sweep.candidates import Candidate, sweep_candidates
from casp_core.job.sweep.shapes import meta_model
from casp_core.method.budget import check_reachable
from casp_core.recovery.data import check_length
from casp_core.settings import PruneConfig


@dataclass(frozen=True)
class JobPlan:
    settings: PruneConfig
    stages: tuple[Stage, ...]  # what the job will report, in order
    candidates: tuple[Candidate, ...]  # a budget's, sized from the config; () for a single ratio


def plan_job(settings: PruneConfig, model_config: PretrainedConfig, model: PreTrainedModel | None = None) -> JobPlan:
    """The job `settings` asks for on a model of `model_config`, or the first refusal (InvalidConfig, whose message
    names the setting first; UnsupportedModel or UnsupportedExport for the model). The reach is checked on `model`
    where the job has loaded it, else on a model of `model_config` built on the meta device."""
    settings.validate()
    family = family_of(model_config)
    check_export(model_config, settings.export)
    family.check_settings(model_config, settings)
    family.check_plain_shape(model_config, settings)
    check_quantization(model_config, settings)
    if settings.recovery.enabled:
        check_length(settings.recovery.max_seq_len, model_config.max_position_embeddings)
    if settings.is_sweep:
        candidates = tuple(sweep_candidates(model_config, settings))  # each one's reach and quantization too
    else:
        check_reachable(model if model is not None else meta_model(model_config), settings)
        candidates = ()
    return JobPlan(settings, job_stages(settings), candidates)
