"""The benches `mlxgw bench` runs: a folder per study, a module per measurement, each with a
one-line description (here, so that `--help` imports no bench and no MLX)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Study:
    name: str
    summary: str
    benches: dict[str, tuple[str, str]]  # command -> (module under mlxgw.bench, one line)


STUDIES = [
    Study(
        "step",
        "One decode step and the engine's own costs, in-process (no HTTP).",
        {
            "breakdown": (
                "step.breakdown",
                "Where a step's time goes: mlxgw's engine beside mlx_lm.server's loop.",
            ),
            "trace": ("step.trace", "Summarise the step traces a served worker wrote (MLXGW_STEP_TRACE)."),
            "cpu-forward": ("step.cpu_forward", "The worker's CPU attention and output head against mlx-lm's own."),
            "choices": ("step.choices", "What logprobs, prompt logprobs and n > 1 cost on the engine."),
            "dtypes": ("step.dtypes", "Single-stream speed of model folders, with and without OpenBLAS."),
            "inprocess": ("step.inprocess", "Baseline: mlx-lm's BatchGenerator driven in-process, same prompts."),
        },
    ),
    Study(
        "speculation",
        "Speculative decoding on against off: in-process, through the server, what a verification costs.",
        {
            "matrix": ("speculation.matrix", "Speculation on against off through the server, every concurrency."),
            "inprocess": ("speculation.inprocess", "The code-edit agent workload with and without speculation."),
            "verify-width": (
                "speculation.verify_width",
                "Verification cost against a plain step, by batch and width.",
            ),
        },
    ),
    Study(
        "agents",
        "Agent clients: models that fit them, first tries, multi-turn reuse, retries, warm restores.",
        {
            "models": ("agents.models", "Which chat model fits the recorded agent requests on this host."),
            "first-try": ("agents.first_try", "Do the real agent CLIs finish on the first try against a gateway."),
            "multiturn": ("agents.multiturn", "A multi-turn agent conversation's TTFT per turn, mlxgw against peers."),
            "retry": ("agents.retry", "How much of a long prompt's prefill a retry after a cut gets back."),
            "warm-restore": ("agents.warm_restore", "TTFT of a long prefix after an unload: cold against restored."),
            "throttle": ("agents.throttle", "A long prompt on a worker made slow on purpose (SIGSTOP duty cycle)."),
            "record-tool-outputs": ("agents.record_tool_outputs", "Record real tool-call outputs as test fixtures."),
        },
    ),
    Study(
        "team",
        "Who gets the machine: fair share, a team's sessions, typists beside agents, admission.",
        {
            "teamday": ("team.teamday", "A team day against mlxgw up: flood vs one, Jain's index, nothing lost."),
            "sessions": ("team.sessions", "A team's agent sessions at once: the shared prefix, turn by turn."),
            "replicas": ("team.replicas", "A team's sessions over N replicas: prefix routing, load, round robin."),
            "typing": ("team.typing_session", "Typists' FIM keystrokes (each superseding the last) beside agents."),
            "short": ("team.short_beside_long", "A short chat beside a long read: its TTFT against alone."),
            "admission": ("team.admission", "Admission policies compared in-process on the real scheduler."),
            "day": ("team.day", "Typists, agents, chat and a batch at once against peers: TTFT per class."),
        },
    ),
    Study(
        "serving",
        "Throughput through the server: against peers, quantized KV, adapters, sharding, embeddings, audio, video.",
        {
            "peers": ("serving.peers", "mlxgw against mlx_lm.server and vllm-mlx on one model, one BLAS."),
            "kv-bits": ("serving.kv_bits", "Quantized KV: memory per token, tok/s and greedy agreement."),
            "adapters": ("serving.adapters", "Mixed LoRA-adapter traffic against the base model alone."),
            "sharded": ("serving.sharded", "A sharded model against the same model in one process."),
            "embeddings": ("serving.embeddings", "Embeddings throughput, and peers on the same texts."),
            "audio": ("serving.audio", "Speech to text through HTTP against faster-whisper, same model."),
            "audio-profile": ("serving.audio_profile", "Where a transcription's time goes inside a Whisper worker."),
            "clip": ("serving.clip", "Four turns about one 30-s clip: later turns' TTFT against the first's, peers."),
            "random-vlm": ("serving.random_vlm", "Build a random-weight Qwen2-VL of Qwen2-VL-2B's size (or tiny)."),
        },
    ),
    Study(
        "overhead",
        "The gateway's own cost: capacity against a bare aiohttp server, the usage ledger.",
        {
            "capacity": ("overhead.capacity", "The gateway's capacity against a bare aiohttp server, same client."),
            "ledger-ab": ("overhead.ledger_ab", "The usage ledger's cost per request end to end, on against off."),
            "ledger-hook": ("overhead.ledger_overhead", "The usage ledger's hook timed on the event loop."),
            "request-path": ("overhead.request_path", "How far one chat request wanders through gateway/ and worker/."),
        },
    ),
    Study(
        "hostile",
        "Hostile and long load: floods, PDF bombs, crashes, a soak.",
        {
            "flood": ("hostile.flood", "Slowloris bodies and idle sockets against mlxgw up."),
            "pdf-flood": ("hostile.pdf_flood", "PDF bombs at once, and how long admin routes and SIGTERM take."),
            "recovery": ("hostile.recovery", "kill -9 a model's worker and time until it serves again."),
            "soak": ("hostile.soak", "A server's RSS sampled every second through a long mixed load."),
        },
    ),
]
