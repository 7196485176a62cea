"""`specserve` command line: serve, generate, serve-config, k8s-manifest, train-default, distill-draft,
eval-pair, bench, bench-adapt."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time

import httpx

from specserve.common.config import load_config
from specserve.decoding.token_map import AUTO_TOKEN_MAP

# No trailing newline: the tokenizer merges a newline with the next line's indentation, so a
# prompt that ends in "\n" leaves the model mid-token.
DEMO_PROMPT = "class Stack:\n    def __init__(self):"
# Subcommands whose module has its own argparse main(argv): name -> (module, help).
FORWARDED_COMMANDS = {
    "train-default": ("specserve.training.default_pair", "train the default draft/target pair"),
    "distill-draft": ("specserve.training.distill", "distil the draft further on the target's own generations "
                      "(--from-capture DIR --out DIR: on a server's captured traffic)"),
    "eval-pair": ("specserve.training.evaluate", "evaluate the default pair (acceptance, latency); --card writes its model card"),
    "bench": ("specserve.bench.run", "benchmark vs target-only and HF assisted generation"),
    "bench-load": ("specserve.bench.load_sweep", "throughput/latency under load: concurrency sweep of server variants"),
    "bench-load-step": ("specserve.bench.load_step", "a 1 -> N -> 1 stream load step against autoscaled pools, traced"),
    "bench-adapt": ("specserve.bench.adapt", "the draft learns a domain its fine-tuned target knows: before/after, alpha curve"),
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that point a command at a pair (over the --config file and environment)."""
    p.add_argument("--target", help="target model directory (Hugging Face format)")
    p.add_argument("--draft", help="draft model directory (it must share the target's tokenizer)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's context)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights dtype of both models (default auto: the checkpoint's on GPU, float32 on CPU)")
    p.add_argument("--tensor-parallel-size", type=int, help="split each target engine over this many rank actors "
                   "(one GPU each on a GPU cluster; target_workers.tensor_parallel_size)")
    p.add_argument("--token-map", help="a file of the token ids the draft model may propose (JSON list or "
                   "torch.save'd tensor): its LM head scores only those (draft.token_map; docs/token-map.md)")
    p.add_argument("--enforce-eager", action="store_true", help="run both models' forwards uncompiled (no "
                   "torch.compile, no CUDA graphs: faster start, slower steps; enforce_eager)")


def config_from_args(args: argparse.Namespace):
    """load_config(--config) with the model flags laid over it; a new --target without --draft
    keeps no draft from the file (it would rarely share the new target's tokenizer): it serves
    target-only unless --draft is given."""
    config = load_config(getattr(args, "config", None))
    data = config.model_dump(mode="json")
    if args.target:
        data["target"] = {**data["target"], "path": args.target, "max_model_len": None}
        if not args.draft:
            data["draft"], data["speculation"] = None, {**data["speculation"], "proposer": "none"}
    if args.draft:
        from specserve.decoding.eagle3_checkpoint import head_format

        # Another draft's token ids are not this one's: it serves its own folder's map, if any.
        data["draft"] = {**(data["draft"] or data["target"]), "path": args.draft, "token_map": AUTO_TOKEN_MAP,
                         "token_map_sampled": False}
        # A folder holding an EAGLE-3 head (either format) is served as one, else as a draft model.
        data["speculation"] = {**data["speculation"], "proposer": "eagle3" if head_format(args.draft) else "draft"}
    if getattr(args, "token_map", None):
        if not data.get("draft"):
            raise SystemExit("--token-map restricts a draft model's proposals: give a draft (--draft or draft.path)")
        data["draft"]["token_map"] = args.token_map
    if args.tokenizer:
        data["tokenizer_path"] = args.tokenizer
    if args.max_model_len:
        data["target"]["max_model_len"] = args.max_model_len
    if getattr(args, "tensor_parallel_size", None):
        data["target_workers"] = {**data["target_workers"], "tensor_parallel_size": args.tensor_parallel_size}
    if args.dtype:
        for role in ("target", "draft"):
            if data.get(role):
                data[role]["dtype"] = args.dtype
    if getattr(args, "enforce_eager", False):
        for role in ("target", "draft"):
            if data.get(role):
                data[role]["enforce_eager"] = True
    return type(config).model_validate(data)


def draft_line(config) -> str:
    """What drafts, for the start-up line: its kind and folder; a head's embeddings are the target's."""
    speculation = config.speculation
    if not speculation.needs_draft_path:
        return speculation.draft_kind
    line = f"{speculation.draft_kind} {config.draft.path}"
    if config.draft_token_map:
        line += f", its greedy steps proposing only the tokens of {config.draft_token_map}"
    if speculation.proposer == "eagle3":
        line += f" (the draft engine reads the target's embeddings and config from {config.target.path})"
    return line


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, temperature: float | None,
                      seed: int | None = None, out=sys.stdout) -> dict:
    """POST /v1/completions with stream=true, echo text as it arrives; return the final chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "seed": seed, "stream": True}
    final: dict = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise SystemExit(f"server error: {chunk['error']['message']}")
            out.write(chunk["choices"][0]["text"])
            out.flush()
            if "speculation" in chunk:
                final = chunk
    out.write("\n")
    return final


def _print_stats(final: dict, elapsed_s: float, out=sys.stdout) -> None:
    usage, spec = final.get("usage") or {}, final.get("speculation") or {}
    tokens = usage.get("completion_tokens", 0)
    print(f"--- {tokens} tokens in {elapsed_s:.2f} s ({tokens / max(elapsed_s, 1e-9):.1f} tok/s), "
          f"finish_reason={final.get('choices', [{}])[0].get('finish_reason')}", file=out)
    print("--- speculation: " + json.dumps(spec), file=out, flush=True)


def _demo(url: str, model: str, prompt: str, max_tokens: int, temperature: float | None, out) -> None:
    print(f"--- POST {url}/v1/completions  prompt={prompt!r}", file=out)
    print(prompt, end="", file=out)
    started = time.perf_counter()
    final = stream_completion(url, model, prompt, max_tokens, temperature, out=out)
    _print_stats(final, time.perf_counter() - started, out)


class Terminated(Exception):
    """SIGTERM arrived: shut down as Ctrl-C does."""


def _raise_terminated(signum, frame) -> None:
    """The first SIGTERM stops the server; any later one is ignored from here on, before the
    exception unwinds, so none can land inside the drain or the stop and cut them short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _config(args: argparse.Namespace):
    """The config file (or defaults) with the command line's model flags applied."""
    config = config_from_args(args)
    budget = getattr(args, "kv_cache_memory_gb", None)
    if budget is None:
        return config
    if budget <= 0:
        raise ValueError(f"--kv-cache-memory-gb must be > 0, got {budget}")
    return config.model_copy(update={name: spec.model_copy(update={"kv_cache_memory_gb": budget})
                                     for name, spec in (("target", config.target), ("draft", config.draft)) if spec})


def _start(config, dashboard: bool = False) -> str:
    """start_local; a start-up that fails ends the command with its cause (a replica's own error,
    or what Serve says of deployments that did not start in time), not a traceback through Ray."""
    from specserve.cluster.local import StartupError, start_local

    try:
        return start_local(config, dashboard=dashboard)
    except (StartupError, TimeoutError) as exc:
        raise SystemExit(f"specserve: {exc}") from None


def _console(args: argparse.Namespace, command: str):
    """specserve_console for a command that runs Ray: Ray's output to a log file unless --verbose;
    the first line says where it went."""
    from specserve.cluster.console import default_log_path, specserve_console

    log_path = None if args.verbose else default_log_path(command)
    if log_path is not None:
        print(f"specserve: Ray's own output goes to {log_path} (--verbose prints it here)", flush=True)
    return specserve_console(log_path)


def cmd_serve(args: argparse.Namespace) -> None:
    config = _config(args)
    with _console(args, "serve") as console:
        _serve(args, config, console)


def _serve(args: argparse.Namespace, config, console) -> None:
    from specserve.cluster.local import drain_local, metrics_url, stop_local

    url = _start(config, dashboard=args.dashboard)
    # SIGTERM is how docker stop, systemd and Kubernetes ask a server to stop. Ray's driver
    # handler (installed by ray.init) dumps a stack and exits without a drain; replace it after
    # start-up so SIGTERM takes the same path as Ctrl-C: stop_local drains and stops everything.
    signal.signal(signal.SIGTERM, _raise_terminated)
    console.say(f"specserve is serving '{config.model_name}' at {url}  (OpenAI API under {url}/v1)")
    console.say(f"drafting: {draft_line(config)}")
    console.say(f"metrics: {metrics_url()}")
    try:
        if args.demo:
            _demo(url, config.model_name, args.demo, args.max_tokens, args.temperature, console.out)
        if args.exit_after_demo:
            return
        console.say("Ctrl-C to stop.")
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, Terminated):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # after Ctrl-C too: nothing cuts the drain short
        grace_s = config.limits.shutdown_grace_s
        console.say(f"specserve: stopping; requests in flight get up to {grace_s:.0f} s to finish")
        left = drain_local(grace_s)
        if left:
            console.say(f"specserve: {left} requests still running after {grace_s:.0f} s are cancelled")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nor the stop (after a demo, say)
        stop_local()
        console.say("specserve: stopped")


def cmd_generate(args: argparse.Namespace) -> None:
    from specserve.cluster.local import stop_local

    config = _config(args)
    with _console(args, "generate") as console:
        url = _start(config)
        try:
            _demo(url, config.model_name, args.prompt, args.max_tokens, args.temperature, console.out)
        finally:
            stop_local()


def cmd_serve_config(args: argparse.Namespace) -> None:
    from specserve.cluster.builder import serve_config_yaml

    text = serve_config_yaml(_config(args))
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    else:
        print(text, end="")


def cmd_k8s_manifest(args: argparse.Namespace) -> None:
    from specserve.cluster.kuberay import DEFAULT_IMAGE, rayservice_yaml

    text = rayservice_yaml(_config(args), image=args.image or DEFAULT_IMAGE, models_claim=args.models_claim or None)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    else:
        print(text, end="")


def cmd_status(args: argparse.Namespace) -> None:
    from specserve.cluster.status import main as status_main

    raise SystemExit(status_main(args.address, args.json))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_request_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML config (defaults: the shipped default pair)")
        p.add_argument("--max-tokens", type=int, default=96)
        p.add_argument("--temperature", type=float, default=None,
                       help="default: the target's generation_config.json (else 1.0); 0 = greedy")
        p.add_argument("--verbose", action="store_true",
                       help="print Ray's own output too (default: to a log file, named at start)")
        add_model_args(p)

    serve_parser = sub.add_parser("serve", help="start a local Ray cluster and serve the OpenAI API")
    add_request_args(serve_parser)
    serve_parser.add_argument("--demo", nargs="?", const=DEMO_PROMPT, default=None,
                              help="answer one request (streamed) once serving")
    serve_parser.add_argument("--exit-after-demo", action="store_true")
    serve_parser.add_argument("--dashboard", action="store_true", help="start the Ray dashboard (metrics)")
    serve_parser.set_defaults(func=cmd_serve)

    generate_parser = sub.add_parser("generate", help="start, answer one prompt over HTTP, stop")
    add_request_args(generate_parser)
    generate_parser.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    generate_parser.set_defaults(func=cmd_generate)

    config_parser = sub.add_parser("serve-config", help="print a Serve config YAML for `serve deploy`")
    config_parser.add_argument("--config")
    add_model_args(config_parser)
    config_parser.add_argument("-o", "--output")
    config_parser.set_defaults(func=cmd_serve_config)

    status_parser = sub.add_parser("status", help="pools, KV sequences, queue depth, policy depth of the running cluster")
    status_parser.add_argument("--json", action="store_true", help="machine-readable")
    status_parser.add_argument("--address", help="Ray address (default: the local cluster)")
    status_parser.set_defaults(func=cmd_status)

    k8s_parser = sub.add_parser("k8s-manifest", help="print a KubeRay RayService manifest")
    k8s_parser.add_argument("--config", default="k8s/specserve-gpu.yaml")
    k8s_parser.add_argument("--image")
    k8s_parser.add_argument("--models-claim", default="specserve-models",
                            help="PersistentVolumeClaim with the checkpoints, mounted read-only at /models in every "
                                 "pod ('' for none: checkpoints inside the image)")
    add_model_args(k8s_parser)
    k8s_parser.add_argument("-o", "--output")
    k8s_parser.set_defaults(func=cmd_k8s_manifest)
    for model_parser in (serve_parser, config_parser, k8s_parser):
        model_parser.add_argument("--kv-cache-memory-gb", type=float, help="KV cache budget (GiB) per engine "
                                  "replica on CPU, target and draft alike (default 4; docs/kv-memory.md)")

    for name, (_, help_text) in FORWARDED_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # their own parser reads the rest

    args, rest = parser.parse_known_args(argv)
    if args.command in FORWARDED_COMMANDS:
        importlib.import_module(FORWARDED_COMMANDS[args.command][0]).main(rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.func(args)
    except (FileNotFoundError, ValueError) as exc:  # bad config or missing models: say so, no traceback
        parser.exit(2, f"specserve: {exc}\n")


if __name__ == "__main__":
    main()
