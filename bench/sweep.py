"""The cost of a sweep of ratios: k ratios through `casp_core.job.sweep.shared_pass.prune_ratios` (the windows, the
sensitivities S_l and the first layer's inputs once; in dense calibration each layer's statistics and Q once too)
against k separate prunes (`prune`, each with its own calibration text, sensitivities and statistics).

Issue 23's goal: k ratios in dense mode cost at most 1 + 0.35 (k - 1) single prunes (k = 6: 0.1 to 0.6), on
ptbwiki-7M and on a 1B-class random LLaMA (bench/memory.py's shape, bfloat16, written with `save_pretrained`:
its weights are random, so only time and memory are reported, never quality). Sequential calibration is measured
beside it (it shares only the windows, S_l and the first layer's inputs).

Each measurement runs in a fresh process that loads the model and then times only the pruning (wall and CPU
seconds; loading is not counted) and reports its peak RSS (VmHWM) and what the loaded model alone held. A single
prune is timed at each of `--single-ratios` (default: every ratio); "one single prune" is their mean, and "k
separate prunes" their sum (k x the mean, marked estimated, when only some ratios were timed).

Writes bench/results/sweep.json and sweep.md (`--out` for another folder). Rows of an earlier sweep.json there that
this run does not measure again (another model, mode or compensation) are kept, each with the machine line, load
and command of the run that measured it.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    all_finite,
    concurrency_note,
    default_datasets_dir,
    default_models_dir,
    finish_machine_info,
    machine_info,
    machine_line,
    run_child,
    write_json,
)
from bench.memory import ONE_B, memory_status_mib, write_model

MODELS = ("ptbwiki-7M", "random-1B")
RANDOM_1B = "random-1B"
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
MODES = ("dense", "sequential")
GOAL_PER_EXTRA_RATIO = 0.35  # each ratio after the first may cost this share of one single prune
# Held-out text the fixtures have whole (the job's default, WikiText-2 train, would take longer to read, which the
# sweep shares: the validation split keeps that part of the gain small).
CALIBRATION_SET = "wikitext2:validation"


def goal_in_singles(k: int) -> float:
    return 1 + GOAL_PER_EXTRA_RATIO * (k - 1)


def prune_settings(args: argparse.Namespace, mode: str, compensation: str = "least_squares") -> dict[str, Any]:
    """Greedy, gradient allocation at alpha 1 (the job's default when sweep.md was measured; the sweep's timing
    and its equality with separate prunes do not depend on it), least-squares compensation unless another is asked
    for, on a short calibration."""
    return {
        "ratio": args.ratios[0],
        "alpha": 1.0,
        "compensation": compensation,
        "device": "cpu",
        "datasets_dir": args.datasets_dir,
        "calibration": {
            "dataset": CALIBRATION_SET,
            "n_samples": args.n_samples,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "mode": mode,
        },
    }


def _stage_seconds(timings: dict[str, dict[str, float]]) -> dict[str, float]:
    return {stage: figures["seconds"] for stage, figures in timings.items()}


def measure_here(model_dir: str, settings: str, ratios: str, how: str) -> None:
    """In this (fresh) process: load the model, then time `how` ("sweep": prune_ratios over all `ratios`;
    "single": prune at the one ratio given) and print the figures as one JSON line."""
    from casp_core.job.sweep.shared_pass import prune_ratios, ratio_config
    from casp_core.method.prune import prune
    from casp_core.model import load_model
    from casp_core.run import Run
    from casp_core.settings import PruneConfig

    model, tokenizer = load_model(model_dir)
    config = PruneConfig(**json.loads(settings))
    chosen = json.loads(ratios)
    loaded_rss = memory_status_mib("VmRSS")
    run = Run()
    start, cpu_start = time.perf_counter(), time.process_time()
    figures: dict[str, Any] = {}
    if how == "sweep":
        per_ratio = []
        for ratio, result in prune_ratios(model, tokenizer, config, chosen, run):
            per_ratio.append(
                {
                    "ratio": ratio,
                    "achieved_ratio": result.achieved_ratio,
                    "seconds_since_start": time.perf_counter() - start,
                    "stage_seconds": _stage_seconds(result.timings),
                }
            )
            del result  # one pruned model at a time, as a job holds them
        figures.update(per_ratio=per_ratio, shared_stage_seconds=_stage_seconds(run.timer.stages))
    else:
        (ratio,) = chosen
        result = prune(model, tokenizer, ratio_config(config, ratio), run, release_dense=True)
        figures.update(ratio=ratio, achieved_ratio=result.achieved_ratio, stage_seconds=_stage_seconds(result.timings))
    figures.update(
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
        loaded_rss_mib=loaded_rss,
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forked parent across exec.
        peak_rss_mib=memory_status_mib("VmHWM"),
    )
    print(json.dumps(figures))


def measure(model_dir: Path, settings: dict[str, Any], ratios: list[float], how: str) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    figures = run_child(
        "bench.sweep",
        ["--measure", str(model_dir), json.dumps(settings), json.dumps(ratios), how],
        f"the {how} measurement",
    )
    # The 1-minute load average as this measurement started and ended: other work on the machine inflates it.
    return {**figures, "loadavg": [load_before, os.getloadavg()[0]]}


def _mean_stages(runs: list[dict[str, float]]) -> dict[str, float]:
    stages = list(dict.fromkeys(stage for run in runs for stage in run))
    return {stage: sum(run.get(stage, 0.0) for run in runs) / len(runs) for stage in stages}


def compare(sweep: dict[str, Any], singles: list[dict[str, Any]], ratios: list[float]) -> dict[str, Any]:
    """The sweep in units of one single prune (the mean of those timed), against the goal."""
    k = len(ratios)
    single = statistics.mean(run["seconds"] for run in singles)
    single_cpu = statistics.mean(run["cpu_seconds"] for run in singles)
    all_timed = sorted(run["ratio"] for run in singles) == sorted(ratios)
    shared = sum(sweep["shared_stage_seconds"].values())
    in_singles = sweep["seconds"] / single
    return {
        "k": k,
        "sweep_seconds": sweep["seconds"],
        "single_seconds": single,
        "separate_seconds": sum(run["seconds"] for run in singles) if all_timed else k * single,
        "separate_estimated": not all_timed,
        "sweep_in_singles": in_singles,
        "sweep_cpu_in_singles": sweep["cpu_seconds"] / single_cpu,
        "goal_in_singles": goal_in_singles(k),
        "goal_met": in_singles <= goal_in_singles(k),
        "shared_seconds": shared,
        # What each ratio adds after the shared work, in single prunes: the goal allows 0.35 (and 1 for the first).
        "per_ratio_in_singles": (sweep["seconds"] - shared) / k / single,
        "per_ratio_stage_seconds": _mean_stages([entry["stage_seconds"] for entry in sweep["per_ratio"]]),
        "single_stage_seconds": _mean_stages([run["stage_seconds"] for run in singles]),
        "sweep_peak_rss_mib": sweep["peak_rss_mib"],
        "single_peak_rss_mib": max(run["peak_rss_mib"] for run in singles),
        "loaded_rss_mib": sweep["loaded_rss_mib"],
    }


def _model_dir(name: str, args: argparse.Namespace, scratch: Path) -> tuple[Path, dict[str, Any]]:
    if name != RANDOM_1B:
        return Path(args.models_dir) / name, {"source": f"fixtures/models/{name}"}
    directory = scratch / name
    size = write_model(directory, ONE_B, args.models_dir)
    return directory, {"source": "random LlamaForCausalLM, bfloat16", "shape": ONE_B, "weights_mib": size / 2**20}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--measure", nargs=4, metavar=("MODEL", "SETTINGS", "RATIOS", "HOW"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument(
        "--runs",
        nargs="+",
        metavar="MODEL:MODE[:COMPENSATION]",
        help="these runs only, in this order (default: every model in every mode, least-squares compensation)",
    )
    parser.add_argument(
        "--single-ratios",
        nargs="*",
        default=[],
        metavar="MODEL=R,R",
        help="time single prunes of MODEL at these ratios only (default: every ratio), e.g. random-1B=0.1,0.6",
    )
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", type=Path, metavar="JSON", help="only rewrite sweep.md (in --out) from this JSON")
    args = parser.parse_args(argv)
    if args.measure:
        measure_here(*args.measure)
        return {}
    if args.render:
        payload = json.loads(args.render.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep.md").write_text(render(payload))
        return payload
    runs = [
        (name, mode, rest[0] if rest else "least_squares")
        for name, mode, *rest in (
            run.split(":") for run in (args.runs or [f"{m}:{mode}" for m in args.models for mode in args.modes])
        )
    ]
    single_ratios = {
        name: [float(r) for r in ratios.split(",")] for name, ratios in (s.split("=", 1) for s in args.single_ratios)
    }

    machine = machine_info()
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    earlier = _earlier_results(args.out / "sweep.json", runs)
    scratch = Path(tempfile.mkdtemp(prefix="casp-sweep-"))
    try:
        model_dirs: dict[str, tuple[Path, dict[str, Any]]] = {}
        for name, mode, compensation in runs:
            if name not in model_dirs:
                model_dirs[name] = _model_dir(name, args, scratch)
            model_dir, model = model_dirs[name]
            settings = prune_settings(args, mode, compensation)
            sweep = measure(model_dir, settings, args.ratios, "sweep")
            singles = [
                measure(model_dir, settings, [ratio], "single") for ratio in single_ratios.get(name, args.ratios)
            ]
            results.append(
                {
                    "model": name,
                    **model,
                    "mode": mode,
                    "compensation": compensation,
                    "measured": {"machine": machine, "command": _command(argv)},
                    "ratios": args.ratios,
                    "comparison": compare(sweep, singles, args.ratios),
                    "sweep": sweep,
                    "singles": singles,
                }
            )
            print(json.dumps({k: results[-1][k] for k in ("model", "mode", "comparison")}, indent=1), flush=True)
            # Written after every run: a long bench stopped part way keeps what it measured.
            payload = _payload(
                machine, args, argv, runs, single_ratios, [*earlier, *results], time.perf_counter() - started
            )
            write_json(args.out / "sweep.json", payload)
            (args.out / "sweep.md").write_text(render(payload))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return payload


def _row_key(result: dict[str, Any]) -> tuple[str, str, str]:
    return result["model"], result["mode"], result["compensation"]


def _earlier_results(path: Path, runs: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """The rows of an earlier sweep.json that this run does not measure again, each with what it was measured
    with (rows written before rows carried it get their file's machine and command)."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    measured = {"machine": earlier["machine"], "command": earlier["settings"]["command"]}
    return [
        {**result, "measured": result.get("measured", measured)}
        for result in earlier["results"]
        if _row_key(result) not in set(runs)
    ]


def _command(argv: list[str] | None) -> str:
    return "python -m bench.sweep " + " ".join(argv if argv is not None else sys.argv[1:])


def _payload(
    machine: dict[str, Any],
    args: argparse.Namespace,
    argv: list[str] | None,
    runs: list[tuple[str, str, str]],
    single_ratios: dict[str, list[float]],
    results: list[dict[str, Any]],
    seconds: float,
) -> dict[str, Any]:
    payload = {
        "machine": finish_machine_info(dict(machine)),
        "settings": {
            **{
                k: v
                for k, v in prune_settings(args, "dense").items()
                if k not in ("datasets_dir", "ratio", "compensation")
            },
            "ratios": args.ratios,
            "runs": [":".join(run) for run in runs],
            "single_ratios": single_ratios,
            "goal": f"k ratios in dense mode <= 1 + {GOAL_PER_EXTRA_RATIO} (k - 1) single prunes",
            "command": _command(argv),
        },
        "results": results,
        "total_seconds": seconds,
    }
    assert all_finite(payload)
    return payload


def render(payload: dict[str, Any]) -> str:
    settings = payload["settings"]
    calibration = settings["calibration"]
    lines = [
        "# A sweep of ratios against separate prunes (issue 23, item 2)",
        "",
        "This run: " + machine_line(payload["machine"]) + ".",
        concurrency_note(payload["machine"]),
        "Each row says when it was measured, at which commit, and the highest 1-minute load average seen as its "
        "measurements started and ended (2 cores: above 2, other work shared the machine and inflated the times).",
        "",
        f"Ratios {', '.join(f'{r:g}' for r in settings['ratios'])}; greedy, gradient allocation, alpha 1, "
        "least-squares compensation unless the row says otherwise, on "
        f"{calibration['n_samples']} x {calibration['seq_len']} tokens of `{calibration['dataset']}`, CPU. "
        f"Goal: {settings['goal']}. Wall seconds of the pruning only "
        "(the model is loaded before the clock starts), each measurement in a fresh process. Command: "
        f"`{settings['command']}`.",
        "",
        "| model | mode | compensation | k | sweep (s) | one single prune (s) | k separate prunes (s) "
        "| sweep in single prunes | goal | met | each ratio after the shared work, in single prunes "
        "| peak RSS sweep / single (MiB) | measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in payload["results"]:
        c = result["comparison"]
        separate = f"{c['separate_seconds']:.1f}" + (" (estimated: k x the mean)" if c["separate_estimated"] else "")
        lines.append(
            f"| {result['model']} | {result['mode']} | {result['compensation']} | {c['k']} "
            f"| {c['sweep_seconds']:.1f} | {c['single_seconds']:.1f} "
            f"| {separate} | **{c['sweep_in_singles']:.2f}** (CPU time: {c['sweep_cpu_in_singles']:.2f}) "
            f"| {c['goal_in_singles']:.2f} | {'yes' if c['goal_met'] else '**no**'} "
            f"| {c['per_ratio_in_singles']:.2f} | {c['sweep_peak_rss_mib']:.0f} / {c['single_peak_rss_mib']:.0f} "
            f"| {_measured(result, payload['machine'])} |"
        )
    lines += ["", "## The goal", "", *(_verdict(result) for result in payload["results"])]
    lines += ["", "## Where the time goes (seconds)", ""]
    for result in payload["results"]:
        c = result["comparison"]
        stages = list(dict.fromkeys([*c["single_stage_seconds"], *result["sweep"]["shared_stage_seconds"]]))
        lines += [
            f"### {result['model']}, {result['mode']} calibration, compensation {result['compensation']}",
            "",
            "| stage | one single prune (mean) | sweep: shared, once | sweep: per ratio (mean) |",
            "|---|---|---|---|",
            *(
                f"| {stage} | {c['single_stage_seconds'].get(stage, 0.0):.2f} "
                f"| {result['sweep']['shared_stage_seconds'].get(stage, 0.0):.2f} "
                f"| {c['per_ratio_stage_seconds'].get(stage, 0.0):.2f} |"
                for stage in stages
            ),
            "",
            f"Peak RSS: the loaded model alone {c['loaded_rss_mib']:.0f} MiB; the sweep "
            f"{c['sweep_peak_rss_mib']:.0f} MiB, a single prune {c['single_peak_rss_mib']:.0f} MiB.",
            "",
        ]
    return "\n".join(lines)


def _measured(result: dict[str, Any], machine: dict[str, Any]) -> str:
    """When, at which commit, and under what load a row was measured."""
    machine = result.get("measured", {}).get("machine", machine)
    loads = [load for run in [result["sweep"], *result["singles"]] for load in run.get("loadavg", [])]
    loads = loads or [*machine.get("loadavg_start", [])[:1], *machine.get("loadavg_end", [])[:1]]
    commit = (machine.get("git_commit") or "unknown")[:10]
    return f"{machine['date'][:16]}, {commit}, load up to {max(loads):.1f}"


def _verdict(result: dict[str, Any]) -> str:
    """Met or not, and what each ratio's own work is made of: the stages that dominate it."""
    c = result["comparison"]
    per_ratio = c["per_ratio_stage_seconds"]
    total = sum(per_ratio.values()) or 1.0
    largest = sorted(per_ratio, key=per_ratio.__getitem__, reverse=True)[:2]
    shares = " and ".join(f"{stage} {per_ratio[stage] / total:.0%}" for stage in largest)
    kind = "the issue's goal" if result["mode"] == "dense" else "the dense-mode goal's bound, for comparison"
    return (
        f"- {result['model']}, {result['mode']} calibration, compensation {result['compensation']}: {c['k']} ratios "
        f"cost {c['sweep_in_singles']:.2f} single prunes against {c['goal_in_singles']:.2f} ({kind}): "
        f"{'met' if c['goal_met'] else '**not met**'}. The shared work took {c['shared_seconds']:.0f} s once; each "
        f"ratio then adds {c['per_ratio_in_singles']:.2f} of a single prune (the goal allows "
        f"{GOAL_PER_EXTRA_RATIO}), mostly {shares} of its own stages."
    )


if __name__ == "__main__":
    main()
