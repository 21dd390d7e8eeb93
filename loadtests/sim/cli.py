"""``fairlane sim``: one simulated vLLM 0.32 server.

Flag names follow ``vllm serve`` where vLLM has one (``--max-num-seqs``,
``--num-gpu-blocks-override``, ``--scheduling-policy``, ``--served-model-name``...), so a
command line written for the simulator reads like one for the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from extproc.core.blockhash import HASH_ALGOS
from extproc.fleet.tokenizer import TokenizerError
from loadtests.sim.kv_publisher import KVEventsConfig
from loadtests.sim.lora import MAX_LORA_RANKS, LoraModule, parse_lora_module
from loadtests.sim.profiles import DEFAULT_PROFILE, PROFILES
from loadtests.sim.server import SIM_KEY, SimConfig, start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="sim-llama-8b", help="model name (default %(default)s)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API accepts (default: --model)",
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=sorted(PROFILES),
        help="step-time model (default %(default)s)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="run the simulated clock this many times faster than the wall clock",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=int,
        default=0,
        help="KV blocks (default: the profile's)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=0, help="default: the profile's")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--seed", type=int, default=0, help="seed of simulated output lengths")
    parser.add_argument(
        "--log-requests",
        type=Path,
        default=None,
        metavar="PATH",
        help="append one JSON line per received request",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="as vLLM: /v1 paths answer 401 without 'Authorization: Bearer KEY' (default: no "
        "key; unlike vLLM, $VLLM_API_KEY is not read, so a shell's key cannot lock out "
        "`fairlane up`)",
    )
    parser.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="as vLLM: publish KV cache events over ZMQ, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\'',
    )
    parser.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="as vLLM: the block hash (the NONE_HASH seed is $PYTHONHASHSEED when set)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="as vLLM: tokenize prompts with this model directory's tokenizer.json and chat "
        "template (default: fairlane's built-in approximation)",
    )
    lora = parser.add_argument_group("LoRA adapters (as vLLM's)")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="as vLLM: requests may name a LoRA adapter as their model",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="as vLLM: adapters loaded at start-up, NAME=PATH or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (PATH is never read)',
    )
    lora.add_argument(
        "--max-loras", type=int, default=1, help="as vLLM: distinct adapters in one batch"
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        choices=MAX_LORA_RANKS,
        help="as vLLM (accepted, otherwise unused)",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="as vLLM: at least --max-loras (accepted, otherwise unused)",
    )
    lora.add_argument(
        "--lora-dtype",
        choices=("auto", "float16", "bfloat16"),
        default="auto",
        help="as vLLM (accepted, unused)",
    )
    lora.add_argument(
        "--fully-sharded-loras", action="store_true", help="as vLLM (accepted, unused)"
    )
    lora.add_argument(
        "--lora-load-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="the simulator's own: engine time (simulated ms) to bring an adapter into one "
        "of the --max-loras GPU slots (default %(default)s)",
    )
    faults = parser.add_argument_group("fault injection (for the gateway's fault tests)")
    faults.add_argument(
        "--fault-delay-headers-s",
        type=float,
        default=0.0,
        metavar="S",
        help="hold every generation request S wall seconds before answering (streams too)",
    )
    faults.add_argument(
        "--fault-metrics",
        choices=("garbage", "hang", "no-itl"),
        default=None,
        help="/metrics answers junk (200), never answers, or lacks the ITL histogram",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        profile=args.profile,
        speedup=args.speedup,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        log_requests=args.log_requests,
        fault_delay_headers_s=args.fault_delay_headers_s,
        fault_metrics=args.fault_metrics,
        api_key=args.api_key,
        kv_events_config=args.kv_events_config,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        tokenizer=args.tokenizer,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules or ()),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_load_ms=args.lora_load_ms,
    )


def _lora_module(text: str) -> LoraModule:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def _serve(config: SimConfig, host: str, port: int) -> None:
    runner = await start(config, host, port)
    faults = ""
    if config.fault_delay_headers_s:
        faults += f", fault: headers delayed {config.fault_delay_headers_s:g}s"
    if config.fault_metrics:
        faults += f", fault: /metrics {config.fault_metrics}"
    publisher = runner.app[SIM_KEY].publisher
    if publisher is not None:
        faults += f", KV events on {publisher.endpoint}"
        if publisher.replay_endpoint is not None:
            faults += f" (replay {publisher.replay_endpoint})"
    if config.enable_lora:
        names = ", ".join(runner.app[SIM_KEY].loras.adapters) or "none loaded"
        faults += f", LoRA: {names} (max {config.max_loras} per batch)"
    print(
        f"fairlane sim: {config.served[0]} ({config.profile}, x{config.speedup:g}) "
        f"on http://{host}:{port}{faults}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:  # flags vLLM refuses at start-up (--lora-modules without LoRA)
        print(f"fairlane sim: error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
            asyncio.run(_serve(config, args.host, args.port))
        else:
            uvloop.run(_serve(config, args.host, args.port))
    except TokenizerError as exc:  # --tokenizer: a directory without a usable tokenizer
        print(f"fairlane sim: error: --tokenizer {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # --lora-modules naming a served model, or one name twice
        print(f"fairlane sim: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="fairlane sim")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
