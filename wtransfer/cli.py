"""The wtransfer command: list backends, run the demos, serve an inference engine over HTTP."""

from __future__ import annotations

import argparse
import socket
import sys

from wtransfer.errors import ConfigError, WTransferError
from wtransfer.registry import list_backends
from wtransfer.transport.stacks import print_stacks_on_sigusr1

SERVER_KEEPALIVE_S = 120
"""How long `wtransfer serve` keeps an idle connection open: far longer than clients reuse
one (`wtransfer.control.clients.CLIENT_KEEPALIVE_S`), so a slow host never closes a connection a
client is writing a request into."""


def cmd_backends(args: argparse.Namespace) -> int:
    """Print every backend with its availability."""
    rows = list_backends()
    if not rows:
        print("no backends installed (from the clone: pip install -e backends/ipc -e "
              "backends/nccl)")
        return 1
    width = max(len("backend"), *(len(n) for n in rows))
    print(f"{'backend':<{width}}  {'available':<9}  {'distribution':<18}  summary / reason")
    for name, info in rows.items():
        detail = info.summary if info.available else info.reason
        print(f"{name:<{width}}  {'yes' if info.available else 'no':<9}  "
              f"{info.distribution:<18}  {detail}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the async-RL demo (see `wtransfer.demos.rl.demo`)."""
    from wtransfer.demos.rl.demo import run_rl_demo

    return run_rl_demo(steps=args.steps, backend=args.backend, local=args.local,
                       lr=args.lr, seed=args.seed, run_dir=args.run_dir,
                       data_parallel_size=args.data_parallel_size, engine=args.engine,
                       trainer_ranks=args.trainer_ranks,
                       tensor_parallel_size=args.tensor_parallel_size,
                       ray_engines=(args.engines or 2) if args.ray else 0,
                       ray_address=args.ray_address, update_staging=args.update_staging,
                       lora=args.lora, delta=args.delta,
                       fleet=1 if args.ray else args.engines or 1, pd=args.pd)


def cmd_transfer_demo(args: argparse.Namespace) -> int:
    """Run the two-process transfer demo (see `wtransfer.demos.transfer`)."""
    from wtransfer.demos.transfer import run_demo

    return run_demo(backend=args.backend, model=args.model, rounds=args.rounds,
                    bucket_mb=args.bucket_mb, checksum=args.checksum)


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan an update for a cluster and print the prediction (see `wtransfer.sim`)."""
    from wtransfer.sim.command import cmd_plan as run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the HTTP server over an inference engine."""
    import os

    try:
        import uvicorn
    except ImportError:
        raise ConfigError("wtransfer serve needs the serve extra: from the clone, "
                          "pip install -e '.[serve]'") from None

    from wtransfer.inference import AsyncEngine, EngineConfig
    from wtransfer.inference.serving.server import build_app

    api_key = args.api_key or os.environ.get("WTRANSFER_API_KEY")
    if (args.role == "decode") != (args.prefill_url is not None):
        raise ConfigError("--role decode and --prefill-url URL go together: a decode "
                          "instance needs its prefill instance, and only it has one")
    listener = _listen(args.host, args.port)  # a taken port fails before the model loads
    args.port = listener.getsockname()[1]  # (--port 0: the one the system gave)
    engine = AsyncEngine(EngineConfig(model=args.model, device=args.device,
                                      weight_transfer_backend=args.weight_transfer_backend,
                                      data_parallel_size=args.data_parallel_size,
                                      tensor_parallel_size=args.tensor_parallel_size,
                                      enable_expert_parallel=args.enable_expert_parallel,
                                      dtype=args.dtype, quantization=args.quantization,
                                      dp_sync_interval=args.dp_sync_interval,
                                      batch_invariant=args.batch_invariant, seed=args.seed,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      num_kv_blocks=args.num_kv_blocks or 1024,
                                      kv_cache_memory_fraction=_kv_fraction(args),
                                      max_num_seqs=args.max_num_seqs,
                                      max_loras=args.max_loras,
                                      max_lora_rank=args.max_lora_rank,
                                      update_rollback={"auto": None, "on": True,
                                                       "off": False}[args.update_rollback],
                                      update_staging=None if args.update_staging == "auto"
                                      else args.update_staging))
    if args.weights_from:
        from wtransfer.inference.serving.join import join_from_peer

        try:
            version = join_from_peer(engine, args.weights_from, host=args.host,
                                     api_key=args.peer_api_key
                                     or os.environ.get("WTRANSFER_PEER_API_KEY"))
        except BaseException:
            engine.shutdown()  # a half-loaded model is never served
            raise
        print(f"wtransfer serve: joined from {args.weights_from}: weight version {version!r}",
              flush=True)
    from wtransfer.inference.serving.disaggregation import Disaggregation
    from wtransfer.inference.serving.join import reachable_host

    pd = Disaggregation(role=args.role, prefill_url=args.prefill_url,
                        prefill_api_key=args.prefill_api_key
                        or os.environ.get("WTRANSFER_PREFILL_API_KEY"),
                        url=f"http://{reachable_host(args.host)}:{args.port}", api_key=api_key)
    try:
        pd.setup(engine)
    except BaseException:
        engine.shutdown()
        raise
    app = build_app(engine, dev_mode=args.dev_mode, api_key=api_key, pd=pd)
    print(serve_banner(args, engine.call("weight_info"), api_key is not None), flush=True)

    class GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT, abort live requests first so every client gets an answer
        (finish_reason "abort") before connections close."""

        def handle_exit(self, sig: int, frame: object) -> None:
            engine.core.submit("abort", None)
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                  timeout_keep_alive=SERVER_KEEPALIVE_S,
                                  timeout_graceful_shutdown=30)).run(sockets=[listener])
    return 0


def _kv_fraction(args: argparse.Namespace) -> float | None:
    """The KV cache's share of free device memory: given, or 0.8 on one CUDA worker without
    --num-kv-blocks (None: sized by block count)."""
    if args.kv_cache_memory_fraction is not None:
        return float(args.kv_cache_memory_fraction)
    one_worker = args.tensor_parallel_size == 1 and args.data_parallel_size == 1
    if args.num_kv_blocks is None and args.device.startswith("cuda") and one_worker:
        return 0.8
    return None


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port`; `ConfigError` saying why when it cannot be
    had (the port is taken, the address is not this host's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # (proto named: asyncio turns Nagle's algorithm off only on connections whose socket says
    # IPPROTO_TCP, and accepted connections take the listener's; with proto 0 every response
    # waited ~40 ms for the client's delayed ACK between its headers and its body)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick "
                          "another --port or --host") from None
    return sock


def _port(text: str) -> int:
    """An argparse type: a TCP port number (0: any free one)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535, got {value}")
    return value


def serve_banner(args: argparse.Namespace, weight_info: dict[str, object],
                 api_key: bool) -> str:
    """What `wtransfer serve` prints at start-up: where it listens and what it serves."""
    staging = weight_info.get("update_staging", "off")
    chosen = "auto: " if args.update_staging == "auto" else ""
    staged = (f"{chosen}{staging} (updates land in a shadow copy while generating, committed "
              "at a step boundary)" if staging != "off" else
              f"{chosen}off (updates land in place, with the engine paused or idle)")
    rollback = ("not needed (staged updates never touch the live weights)" if staging != "off"
                else f"{'on' if weight_info.get('rollback') else 'off'} ("
                     + {"auto": "auto, when the model fits in half the available host memory",
                        "on": "on", "off": "off"}[args.update_rollback] + ")")
    return "\n".join([
        f"wtransfer serve: http://{args.host}:{args.port}",
        f"  model {args.model} on {args.device}, data_parallel_size {args.data_parallel_size}, "
        f"tensor_parallel_size {args.tensor_parallel_size}"
        f"{' (experts split)' if args.enable_expert_parallel else ''}, "
        f"weight transfer backend {args.weight_transfer_backend}",
        "  dev mode: " + ("on (pause/resume and weight-update routes; never expose to "
                          "untrusted clients)" if args.dev_mode else
                          "off (generate, /health and /metrics only; --dev-mode adds the RL "
                          "routes)"),
        f"  update staging: {staged}",
        *([f"  LoRA: {args.max_loras} adapter slot(s) of rank <= {args.max_lora_rank} "
           "(requests name one in sampling_params.lora)"] if args.max_loras else []),
        f"  update rollback: {rollback}",
        f"  api key: {'required' if api_key else 'none'}",
    ])


def _positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wtransfer")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `wtransfer` command."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="wtransfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"wtransfer {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends and whether they can run here",
                   formatter_class=fmt).set_defaults(func=cmd_backends)
    rl = sub.add_parser("demo", formatter_class=fmt,
                        help="async RL: a trainer improves a policy while a server keeps "
                             "generating, weights flowing mid-flight")
    rl.add_argument("--steps", type=_positive, default=40, help="training steps")
    rl.add_argument("--backend", default="ipc", choices=["ipc", "nccl", "ucx"],
                    help="how the weights move (nccl: gloo on CPU; ucx: needs UCXX)")
    rl.add_argument("--local", action="store_true", help="in-process engine instead of a server")
    rl.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    rl.add_argument("--seed", type=int, default=0, help="seed of the policy, task and sampling")
    rl.add_argument("--run-dir", default=None,
                    help="where rl.png and metrics.json go (None: runs/rl-<timestamp>)")
    rl.add_argument("--data-parallel-size", type=_positive, default=1,
                    help="serve the policy from N lockstep engine ranks")
    rl.add_argument("--tensor-parallel-size", type=_positive, default=1,
                    help="serve the policy with N tensor-parallel workers per engine")
    rl.add_argument("--trainer-ranks", type=_positive, default=1,
                    help="train the policy with N FSDP2 ranks (gloo) that send together")
    rl.add_argument("--update-staging", choices=["auto", "off", "swap", "copy"],
                    default="auto",
                    help="our engine: stage updates while generating (auto: swap when the "
                         "shadow fits); off: pause around each in-place update")
    rl.add_argument("--engine", choices=["wtransfer", "vllm"], default="wtransfer",
                    help="serve the policy with our engine or an in-process vLLM (needs vllm "
                         "and wtransfer-vllm: make test-vllm builds .venv-vllm)")
    rl.add_argument("--lora", action="store_true",
                    help="train a LoRA adapter on the frozen policy and send only the adapter "
                         "(the server serves it unmerged, max_loras=1)")
    rl.add_argument("--delta", action="store_true",
                    help="after the first update send only the elements that changed (the "
                         "table's changed column shows the fraction; LoRA adapters always "
                         "travel whole)")
    rl.add_argument("--pd", action="store_true",
                    help="serve the policy from a prefill and a decode instance (P/D): the "
                         "decode instance decodes from the prefill instance's K/V of the same "
                         "weight version")
    rl.add_argument("--ray", action="store_true",
                    help="serve the policy from engine actors on Ray (needs the ray extra)")
    rl.add_argument("--ray-address", default=None,
                    help="with --ray: the cluster to join (None: start a local one)")
    rl.add_argument("--engines", type=_positive, default=None,
                    help="how many engines serve the policy: with --ray, engine actors "
                         "(default 2); else wtransfer serve instances updated as one fleet, "
                         "one killed and replaced mid-run (default 1: one server)")
    rl.set_defaults(func=cmd_demo)
    demo = sub.add_parser("transfer-demo", formatter_class=fmt,
                          help="push a model's weights into another process and prove they "
                               "landed")
    demo.add_argument("--backend", default="ipc", help="a backend from `wtransfer backends`")
    demo.add_argument("--model", default="demo", help="demo, mixed, qwen3-0.6b, ...")
    demo.add_argument("--rounds", type=_positive, default=5, help="updates to send")
    demo.add_argument("--bucket-mb", type=_positive, default=32, help="bucket size in MiB")
    demo.add_argument("--checksum", action="store_true", help="checksum every bucket")
    demo.set_defaults(func=cmd_transfer_demo)
    serve = sub.add_parser("serve", formatter_class=fmt,
                           help="serve an inference engine over HTTP")
    serve.add_argument("--model", default="tiny", help="tiny, small, qwen3-0.6b or a "
                                                       "checkpoint directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on")
    serve.add_argument("--device", default="cpu", help="cpu or cuda:N")
    serve.add_argument("--seed", type=int, default=0, help="seed of a named model's weights")
    serve.add_argument("--dev-mode", action="store_true",
                       help="enable pause/resume and weight-update endpoints")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                                                       "(or set WTRANSFER_API_KEY)")
    serve.add_argument("--weight-transfer-backend", default="ipc",
                       help="the backend weight updates arrive through")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine-core processes stepping in lockstep behind this server")
    serve.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="worker processes per data-parallel rank, each holding a slice of "
                            "every matrix")
    serve.add_argument("--enable-expert-parallel", action="store_true",
                       help="an MoE model's experts split across the tensor-parallel workers")
    serve.add_argument("--dp-sync-interval", type=int, default=32,
                       help="steps between the ranks' state syncs (pause agreement, wave end)")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="a sequence's tokens never depend on its batch-mates")
    serve.add_argument("--max-num-batched-tokens", type=int, default=4096,
                       help="token budget of one step (prompt + max_tokens must fit it + 1)")
    serve.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV-cache blocks of 16 tokens (default: 1024; on one CUDA worker, "
                            "what --kv-cache-memory-fraction of the free memory holds)")
    serve.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                       help="on CUDA, one worker: the fraction of the memory free after the "
                            "weights and the shadow that the KV cache takes (default 0.8 "
                            "unless --num-kv-blocks is given)")
    serve.add_argument("--max-num-seqs", type=int, default=64,
                       help="sequences computed in one step")
    serve.add_argument("--update-staging", choices=["auto", "off", "swap", "copy"],
                       default="auto",
                       help="land updates in a shadow copy while generating and commit at a "
                            "step boundary by swapping storages or copying (auto: swap when "
                            "the extra copy fits in half the free memory)")
    serve.add_argument("--dtype", default=None,
                       help="parameter dtype, e.g. bfloat16 (default: the model config's)")
    serve.add_argument("--quantization", choices=["fp8"], default=None,
                       help="store the attention and MLP projections as FP8 with 128x128 "
                            "block scales; trainers send them in the checkpoint dtype or "
                            "already quantized (wtransfer.quant.source.Fp8Source)")
    serve.add_argument("--max-loras", type=int, default=0,
                       help="LoRA adapter slots; trainers send adapters alone "
                            "(wtransfer.trainer.lora.LoRASource), needs staged updates")
    serve.add_argument("--max-lora-rank", type=int, default=16,
                       help="the largest adapter rank a slot holds")
    serve.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                       help="prefill/decode disaggregation: a prefill instance computes "
                            "prompts' K/V and hands it over; a decode instance (with "
                            "--prefill-url) decodes from it")
    serve.add_argument("--prefill-url", default=None, metavar="URL",
                       help="with --role decode: the prefill instance")
    serve.add_argument("--prefill-api-key", default=None,
                       help="the --api-key of the prefill instance (or set "
                            "WTRANSFER_PREFILL_API_KEY)")
    serve.add_argument("--weights-from", default=None, metavar="URL",
                       help="start with the current weights and weight version of the running "
                            "instance at URL (its --dev-mode routes), copied engine to engine "
                            "over this server's backend before serving")
    serve.add_argument("--peer-api-key", default=None,
                       help="the --api-key of the instance --weights-from names (or set "
                            "WTRANSFER_PEER_API_KEY)")
    serve.add_argument("--update-rollback", choices=["auto", "on", "off"], default="auto",
                       help="restore the old weights when an update fails (auto: when the "
                            "model fits in half the available host memory)")
    serve.set_defaults(func=cmd_serve)
    plan = sub.add_parser("plan", formatter_class=fmt,
                          help="plan an M->N update for a cluster and predict its time")
    from wtransfer.sim.command import add_arguments

    add_arguments(plan)
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `wtransfer` command."""
    print_stacks_on_sigusr1()
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except WTransferError as exc:  # a user error: say what to fix, no traceback
        print(f"wtransfer {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
