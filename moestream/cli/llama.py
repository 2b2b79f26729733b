"""llama.cpp's flags on moestream's commands: each taken with its llama.cpp meaning (in args.py and main.py), or
refused here in one line that names what to use instead. The tables cover llama-cli and llama-completion (for
`run`), llama-server (`serve`) and llama-bench (`bench`) as vendored by llama-cpp-python 0.3.36
(tests/cli/llama_flags.txt)."""

from __future__ import annotations

import argparse

LOAD_MODES = {"none": "pinned", "mmap": "pageable"}  # llama.cpp --load-mode -> --host-memory

SAMPLERS = (
    "--temp, --top-k, --top-p, --min-p, --repeat-penalty, --presence-penalty, --frequency-penalty, --logit-bias "
    "and --seed"
)

# What to use instead -> the llama.cpp flags it answers (space-separated), per group of commands.
ENGINE = {  # every command that loads a model to run it (run, bench, profile, serve)
    "moestream always maps the file; streamed experts are page-locked in place (-lm none)": "--no-mmap",
    "streamed experts are page-locked in place by default (--host-memory pinned)": "--mlock",
    "use -ncmoe N (or --cpu-moe) to keep experts in host RAM": "-ot --override-tensor -ncffn --n-cpu-ffn",
    "moestream splits each streamed layer's experts over --devices (expert parallel)": "-sm --split-mode",
    "the first of --devices (or --device) runs attention and the dense weights": "-mg --main-gpu",
    "--n-cpu-moe auto --vram-budget SIZE streams as many layers as the budget needs": (
        "-fit --fit -fitt --fit-target -fitc --fit-ctx"
    ),
    "moestream keeps each weight as stored in the file, on --device or in host RAM (-ncmoe)": (
        "--repack -nr --no-repack --no-host --op-offload --no-op-offload -nopo -lzm --lazy-mode"
    ),
    "the KV cache lives on the compute device (--device)": "-nkvo --no-kv-offload -kvo --kv-offload",
    "the KV cache holds --ctx positions; generation stops when it is full": (
        "--keep --swa-full -ctxcp --ctx-checkpoints --swa-checkpoints -cram --cache-ram --context-shift "
        "--no-context-shift -dt --defrag-thold -gan --grp-attn-n -gaw --grp-attn-w"
    ),
    "moestream uses the RoPE settings in the model file": (
        "--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor "
        "--yarn-attn-factor --yarn-beta-slow --yarn-beta-fast"
    ),
    "moestream reads the file's metadata as written and checks every tensor's shape and type at load": (
        "--override-kv --check-tensors"
    ),
    "moestream sets one CPU thread count: -t N": (
        "-tb --threads-batch -C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb "
        "--cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch --numa"
    ),
    "moestream serve --max-seqs N serves N sequences at once": "-np --parallel",
    "download the GGUF file and pass -m FILE": (
        "-hf -hfr --hf-repo -hff --hf-file -hft --hf-token -mu --model-url -dr --docker-repo --offline -cl --cache-list"
    ),
    "pass the GGUF file with -m FILE": (
        "--gpt-oss-20b-default --gpt-oss-120b-default --vision-gemma-4b-default --vision-gemma-12b-default "
        "--spec-default --embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default "
        "--fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default"
    ),
    "moestream loads no adapters: merge them into the GGUF file": (
        "--lora --lora-scaled --lora-init-without-apply --control-vector --control-vector-scaled "
        "--control-vector-layer-range"
    ),
    "moestream runs text models only": (
        "-mm --mmproj -mmu --mmproj-url --mmproj-auto --no-mmproj --no-mmproj-auto --mmproj-offload "
        "--no-mmproj-offload -mmdev --mmproj-device --image --audio --video --image-min-tokens --image-max-tokens "
        "--video-fps --video-timestamp-interval --video-ffmpeg-dir --mtmd-batch-max-tokens"
    ),
    "moestream has no speculative decoding": (
        "-md --model-draft --spec-draft-model -hfd -hfrd --hf-repo-draft --spec-draft-hf -td --threads-draft "
        "--spec-draft-threads -tbd --threads-batch-draft --spec-draft-threads-batch -Cd --cpu-mask-draft "
        "--spec-draft-cpu-mask -Crd --cpu-range-draft --spec-draft-cpu-range --cpu-strict-draft "
        "--spec-draft-cpu-strict --prio-draft --spec-draft-prio --poll-draft --spec-draft-poll -Cbd "
        "--cpu-mask-batch-draft --spec-draft-cpu-mask-batch --cpu-strict-batch-draft --spec-draft-cpu-strict-batch "
        "--prio-batch-draft --spec-draft-prio-batch --poll-batch-draft --spec-draft-poll-batch -ctkd "
        "--cache-type-k-draft --spec-draft-type-k -ctvd --cache-type-v-draft --spec-draft-type-v -otd "
        "--override-tensor-draft --spec-draft-override-tensor -cmoed --cpu-moe-draft --spec-draft-cpu-moe -ncmoed "
        "--n-cpu-moe-draft --spec-draft-n-cpu-moe --spec-draft-ncmoe --spec-draft-n-max --spec-draft-n-min "
        "--spec-synth-len --spec-synth-rates --draft-p-split --spec-draft-p-split --draft-p-min --spec-draft-p-min "
        "--spec-draft-backend-sampling --no-spec-draft-backend-sampling -devd --device-draft --spec-draft-device "
        "-ngld --gpu-layers-draft --n-gpu-layers-draft --spec-draft-ngl --spec-type --spec-ngram-mod-n-min "
        "--spec-ngram-mod-n-max --spec-ngram-mod-n-match --spec-ngram-simple-size-n --spec-ngram-simple-size-m "
        "--spec-ngram-simple-min-hits --spec-ngram-map-k-size-n --spec-ngram-map-k-size-m "
        "--spec-ngram-map-k-min-hits --spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m "
        "--spec-ngram-map-k4v-min-hits --spec-ngram-size-n --spec-ngram-size-m --spec-ngram-min-hits --draft "
        "--draft-n --draft-max --draft-min --draft-n-min -lcs --lookup-cache-static -lcd --lookup-cache-dynamic"
    ),
    "moestream splits experts over this machine's GPUs with --devices": "-rpc --rpc",
    "`moestream probe` names the device it measures": "--list-devices",
    "moestream writes its messages to stderr, one line each": (
        "--log-disable --log-file --log-jsonl --no-log-jsonl --log-prompts-dir --log-colors -v --verbose "
        "--log-verbose -lv --verbosity --log-verbosity --log-prefix --no-log-prefix --log-timestamps "
        "--no-log-timestamps --completion-bash"
    ),
    "use --help": "--usage",
}

CHAT = (  # flags of llama.cpp's chat templates and conversations
    "-cnv --conversation -i --interactive -if --interactive-first --in-prefix --in-prefix-bos --in-suffix -mli "
    "--multiline-input -r --reverse-prompt -sys --system-prompt -sysf --system-prompt-file --jinja --no-jinja "
    "--chat-template --chat-template-file --chat-template-kwargs --reasoning-format -rea --reasoning "
    "--reasoning-effort --reasoning-budget --reasoning-budget-message --reasoning-preserve --no-reasoning-preserve "
    "--skip-chat-parsing --no-skip-chat-parsing"
)
OTHER_SAMPLERS = (
    "--samplers --sampler-seq --sampling-seq --top-nsigma --top-n-sigma --xtc-probability --xtc-threshold "
    "--typical --typical-p --dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n "
    "--dry-sequence-breaker --adaptive-target --adaptive-decay --dynatemp-range --dynatemp-exp --mirostat "
    "--mirostat-lr --mirostat-ent -l --logit-bias --grammar --grammar-file -j --json-schema -jf --json-schema-file "
    "-bs --backend-sampling"
)

RUN = {
    f"moestream samples with {SAMPLERS}": OTHER_SAMPLERS,
    "moestream run generates once from -p (or -f); --chat wraps it in the file's chat template": (
        CHAT + " --server-base"
    ),
    "moestream run prints the text on stdout and one line of stats on stderr": (
        "--verbose-prompt --display-prompt --no-display-prompt -co --color --perf --no-perf --show-timings "
        "--no-show-timings --simple-io -sp --special -e --escape --no-escape -ptc --print-token-count"
    ),
    "redirect the output instead: moestream run ... > FILE": "-o --output --output-file",
    "give the prompt as text (-p TEXT or -f FILE)": "-bf --binary-file",
    "moestream run keeps no prompt cache": "--prompt-cache --prompt-cache-all --prompt-cache-ro",
    "moestream run does no warm-up pass (moestream bench does)": "--warmup --no-warmup",
}

SERVE = {
    "each request gives its own sampling (temperature, top_p, min_p, seed, ...)": (
        "--temp --temperature --top-k --top-p --min-p --repeat-penalty --repeat-last-n --presence-penalty "
        "--frequency-penalty -s --seed --ignore-eos " + OTHER_SAMPLERS
    ),
    "each request gives max_tokens; --max-tokens caps it": "-n --predict --n-predict",
    "the server renders the file's chat template": CHAT,
    "each sequence has its own KV cache (--max-seqs); --cache-prompt reuses shared prefixes, -cram sizes its RAM": (
        "-kvu --kv-unified -no-kvu --no-kv-unified --kv-unified-per-slot "
        "--cache-reuse --cache-idle-slots --no-cache-idle-slots -cms --checkpoint-min-step --slot-save-path -sps "
        "--slot-prompt-similarity"
    ),
    "moestream serve batches the decode steps of its sequences (--max-seqs)": "-nocb --no-cont-batching",
    "moestream serve answers in OpenAI's formats, with no warm-up and no switches for the text": (
        "--perf --no-perf -e --escape --no-escape -sp --special --warmup --no-warmup"
    ),
    "moestream serve generates text only (/v1/chat/completions, /v1/completions)": (
        "--spm-infill --pooling --embedding --embeddings --rerank --reranking --embd-normalize"
    ),
    "moestream serve has the OpenAI endpoints, /health and /metrics on --host and --port, and no more": (
        "--reuse-port --path --cors-origins --cors-methods --cors-headers --cors-credentials --no-cors-credentials "
        "--api-prefix --ui-config --webui-config --ui-config-file --webui-config-file --ui-mcp-proxy "
        "--webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy --tools --tools-runtime --mcp-servers-config "
        "--mcp-servers-json -ag --agent -no-ag --no-agent --ui --webui --no-ui --no-webui --ssl-key-file "
        "--ssl-cert-file --sse-ping-interval --props --no-slots --media-path "
        "--models-dir --models-preset --models-max --models-autoload --no-models-autoload --prefill-assistant "
        "--no-prefill-assistant --sleep-idle-seconds --tags"
    ),
}

BENCH = {
    "moestream bench has no equivalent yet: run -p and -n tests (-d N: after N tokens of context)": "-pg",
    "moestream bench prints each row as it finishes; errors go to stderr": "-oe --output-err --progress",
    "moestream bench runs its tests back to back": "--delay",
    "moestream bench warms up before every timed test": "--no-warmup",
    "moestream bench measures generation, not embeddings": "-embd --embeddings",
}

COMMANDS = {"run": (ENGINE, RUN), "serve": (ENGINE, SERVE), "bench": (ENGINE, BENCH), "profile": (ENGINE,)}


class _Refused(argparse.Action):
    """A llama.cpp flag we do not take (hidden from --help): exit 2 with one line naming what to use instead."""

    def __init__(self, option_strings, dest, instead: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(
            2, f"moestream: error: {option_string} is a llama.cpp flag moestream does not take; {self.instead}\n"
        )


def refused(command: str) -> dict[str, str]:
    """Each llama.cpp flag refused on a command -> the line's advice."""
    return {flag: instead for table in COMMANDS[command] for instead, flags in table.items() for flag in flags.split()}


def refuse_llama_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The llama.cpp flags of command's counterpart that p does not take: each refused in one line."""
    taken = set(p._option_string_actions)
    by_advice: dict[str, list[str]] = {}
    for flag, instead in refused(command).items():
        if flag not in taken:
            by_advice.setdefault(instead, []).append(flag)
    for instead, flags in by_advice.items():
        p.add_argument(*flags, action=_Refused, instead=instead, default=argparse.SUPPRESS)


def add_llama_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flags that every engine command takes with their meaning (or as harmless)."""
    p.add_argument(
        "-ngl",
        "--n-gpu-layers",
        "--gpu-layers",
        default=None,
        help="accepted for llama.cpp command lines: the dense part of every layer runs on --device",
    )
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for CPU work (default: torch's)")
    p.add_argument(
        "-fa",
        "--flash-attn",
        nargs="?",
        const="on",
        default=None,
        choices=("on", "off", "auto", "1", "0", "-1"),
        help="accepted for llama.cpp command lines: attention always uses PyTorch's fused kernels",
    )
    p.add_argument("-b", "--batch-size", type=int, default=None, help="logical batch: caps -ub, as in llama.cpp")
    p.add_argument(
        "-lm",
        "--load-mode",
        default=None,
        choices=tuple(LOAD_MODES),
        help="llama.cpp's load mode: none = --host-memory pinned (default), mmap = --host-memory pageable",
    )


def llama_notes(a: argparse.Namespace) -> list[str]:
    """What the accepted llama.cpp flags do here, where that is not what a llama.cpp user would expect."""
    notes = []
    for value in [t.strip() for t in a.n_gpu_layers.split(",")] if a.n_gpu_layers is not None else []:
        if value not in ("all", "auto", "-1") and not (value.lstrip("-").isdigit() and int(value) >= 99):
            notes.append(
                f"-ngl {value} is ignored: every layer's attention and dense weights run on --device; use "
                "--n-cpu-moe to keep experts in host RAM, or --device cpu to run on the CPU"
            )
    if a.flash_attn in ("off", "0"):
        notes.append("-fa off is ignored: attention always uses PyTorch's fused kernels")
    return notes
