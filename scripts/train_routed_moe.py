#!/usr/bin/env python3
"""Trains a small DeepSeek-V2-architecture MoE so that its routing is learned, not random.

Random-weight checkpoints (`specter-pack synth`) have the real shapes but nearly uniform routing:
consecutive tokens share few experts and a verify window touches almost every expert, which is the
pessimistic case for expert caching and for Specter's prefetch. This script trains a model with
DeepSeek-V2-Lite's real widths (hidden 2048, 64 routed experts of 1408, top-6, 2 shared experts,
MLA with kv_lora 512 and no q_lora, 16 heads; layer 0 dense with intermediate 10944) but few
layers and a small vocabulary, on text that is on every machine with Python: the .py sources of
the installed packages. It writes a Hugging Face checkpoint directory that
`specter-pack convert` accepts:

  config.json, model.safetensors (float16), tokenizer.json (byte-level BPE trained here),
  generation_config.json, train_report.json (held-out loss, routing statistics, steps, tokens, time)

How to run on the GPU machine (one H200; about 5 minutes in all with the defaults, see below):

  python3 scripts/train_routed_moe.py --out /dev/shm/routed && \
      specter-pack convert /dev/shm/routed -o /dev/shm/routed.specter

Time: --minutes (default 4.5) is the wall-clock budget from the start of the script to the end of
training, so reading the corpus (96 MB), training the tokenizer (on 32 MB), encoding, building the
model and choosing the experts implementation come out of it (estimated at under a minute on 16
cores; the log prints each stage's time); held-out evaluation and saving come after it (estimated
at tens of seconds). Memory with the defaults (4 layers, 1.87 B parameters): float32
master weights, gradients and AdamW state 28 GiB of VRAM plus activations; the float16
checkpoint is 3.7 GB.

Routing is trained with a Switch-style load-balancing loss computed from the routers' logits
(transformers' DeepseekV2 returns no router logits or auxiliary loss, so forward hooks on every
router collect them). At the end the script prints per layer: the entropy of the expert load
against uniform, the share of routings that go to the 16 most used experts, how often a token's
top-k expert set equals the previous token's and the mean overlap of the two sets, and the mean
number of unique experts in windows of 17 consecutive tokens (a depth-16 verify window), each
beside what uniform routing would give.

--tiny shrinks every width (hidden 256, experts of 128, 2 heads) for a CPU smoke test of the
script only. Real runs must not use it: with tiny widths an expert copy is nearly free, which hides
exactly the cost the runtime exists to manage, so a --tiny checkpoint says nothing about Specter's
speed.

CPU smoke test: train_routed_moe.py --device cpu --tiny --minutes 0.5 --layers 2 --out DIR
"""

import argparse
import hashlib
import json
import math
import os
import random
import site
import sys
import sysconfig
import time

T_START = time.time()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV2Config  # noqa: E402

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# A verify window at depth 16 scores 17 rows; its union of experts is what must be resident.
WINDOW = 17
# Files larger than this are mostly generated tables or vendored blobs, not code.
MAX_FILE_BYTES = 512 * 1024
MIN_FILE_BYTES = 256


def log(msg):
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--layers", type=int, default=4, help="decoder layers; layer 0 is dense (default 4)")
    p.add_argument("--minutes", type=float, default=4.5,
                   help="wall-clock budget from start to the end of training (default 4.5)")
    p.add_argument("--seq", type=int, help="training sequence length (default 512; --tiny 256)")
    p.add_argument("--batch", type=int, help="sequences per step (default 16; --tiny 4)")
    p.add_argument("--vocab", type=int, help="BPE vocabulary size (default 8192; --tiny 2048)")
    p.add_argument("--max-files", type=int, default=0, help="at most this many source files (0: no limit)")
    p.add_argument("--max-bytes", type=float, help="at most this many MB of source text (default 96; --tiny 8)")
    p.add_argument("--tokenizer-mb", type=float,
                   help="MB of training text the tokenizer is trained on (default 32; --tiny 4)")
    p.add_argument("--heldout", type=float, default=0.02,
                   help="fraction of source directories held out for evaluation (default 0.02)")
    p.add_argument("--eval-tokens", type=int, help="held-out tokens to evaluate (default 262144; --tiny 16384)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps (default 100)")
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight (default 0.01)")
    p.add_argument("--log-every", type=int, default=25, help="log every N steps (default 25)")
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for smoke tests")
    p.add_argument("--experts-impl", default="auto", choices=["auto", "eager", "grouped_mm"],
                   help="transformers' routed-experts implementation for training; auto times both (default)")
    p.add_argument("--q-lora-rank", type=int, default=0,
                   help="MLA queries through a low-rank projection of this rank (0, the default: none, as "
                        "DeepSeek-V2-Lite). llama.cpp reads a DeepSeek-V2 model without one only at 26 or 27 "
                        "layers, so a few-layer model compared with llama.cpp needs one")
    p.add_argument("--tiny", action="store_true",
                   help="tiny widths for a CPU smoke test only; never for real runs (see the docstring)")
    args = p.parse_args()
    # --tiny also shrinks the corpus and batch so a smoke test fits in its budget on two CPU cores.
    defaults = dict(seq=(512, 256), batch=(16, 4), vocab=(8192, 2048), max_bytes=(96.0, 8.0),
                    tokenizer_mb=(32.0, 4.0), eval_tokens=(262144, 16384))
    for k, (real, tiny) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else real)
    return args


# ---------------------------------------------------------------------------------------------
# Corpus

def source_roots():
    """Directories whose .py files form the corpus: the standard library, site-packages, and the
    directories holding torch and transformers (in case they sit outside site-packages)."""
    cands = [sysconfig.get_paths().get("stdlib", "")] + list(site.getsitepackages())
    try:
        cands.append(site.getusersitepackages())
    except AttributeError:
        pass
    for mod in (torch, transformers):
        cands.append(os.path.dirname(os.path.dirname(mod.__file__)))
    roots = []
    for c in cands:
        if not c or not os.path.isdir(c):
            continue
        r = os.path.realpath(c)
        # Keep only outermost roots so no file is read twice.
        if any(r == x or r.startswith(x + os.sep) for x in roots):
            continue
        roots = [x for x in roots if not x.startswith(r + os.sep)] + [r]
    return sorted(roots)


def list_sources(roots):
    files = []
    for ri, root in enumerate(roots):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    size = os.path.getsize(path)
                except OSError:
                    continue
                if MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
                    files.append((ri, os.path.relpath(path, root), size))
    return files


def is_heldout(relpath, fraction):
    # Hold out whole directories: a package's sibling files (modeling_x.py, modular_x.py) are
    # near copies, and splitting them between train and held-out would flatter the held-out loss.
    h = hashlib.sha1(os.path.dirname(relpath).encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32 < fraction


def load_corpus(args):
    roots = source_roots()
    files = list_sources(roots)
    random.Random(args.seed).shuffle(files)  # mix packages; the order is fixed by the seed
    budget = int(args.max_bytes * 1e6)
    train, held = [], []
    total = 0
    for ri, rel, size in files:
        if args.max_files and len(train) + len(held) >= args.max_files:
            break
        if total >= budget:
            break
        try:
            with open(os.path.join(roots[ri], rel), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text.encode("utf-8"))
        (held if is_heldout(rel, args.heldout) else train).append(text)
    return roots, len(files), train, held, total


def build_tokenizer(texts, vocab, mb):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample, n = [], 0
    for t in texts:
        if n >= mb * 1e6:
            break
        sample.append(t)
        n += len(t)
    tok.train_from_iterator(sample, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"tokenizer: special token {name} got id {tok.token_to_id(name)}, want {i}")
    return tok


def encode_stream(tok, texts):
    """Documents as one stream: <s> doc </s> <s> doc </s> ..."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Model

def model_config(args, vocab):
    yarn = {  # DeepSeek-V2-Lite's rope, so the runtime's YaRN path is what gets exercised
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
    if args.tiny:
        # Multiples of 128 so the INT4 draft layout (K % 128, N % 64) still converts.
        w = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=2,
                 kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
    else:
        w = dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_attention_heads=16,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return DeepseekV2Config(
        vocab_size=vocab,
        num_hidden_layers=args.layers,
        num_key_value_heads=w["num_attention_heads"],
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        q_lora_rank=args.q_lora_rank or None,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_parameters=yarn,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
        **w,
    )


class RouterTap:
    """Forward hooks on every MoE router: keeps its logits (for the balance loss) and top-k ids."""

    def __init__(self, model):
        self.logits, self.topk = [], []
        self.keep_logits = True
        self.routers = []
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                gate.register_forward_hook(self._hook)
                self.routers.append(gate)
        if not self.routers:
            raise SystemExit("no MoE router found: is first_k_dense_replace >= layers?")

    def _hook(self, module, inputs, output):
        router_logits, _, topk_idx = output
        if self.keep_logits:
            self.logits.append(router_logits)
        self.topk.append(topk_idx.detach())

    def clear(self):
        self.logits.clear()
        self.topk.clear()

    def balance_loss(self, num_experts, top_k):
        # Switch Transformer's loss, per layer: E * sum_i f_i * P_i, where f_i is the share of
        # routings that went to expert i and P_i its mean router probability. 1.0 when balanced.
        total = 0.0
        for logits, idx in zip(self.logits, self.topk):
            probs = logits.float().softmax(-1)
            counts = torch.zeros(num_experts, device=logits.device).index_add_(
                0, idx.reshape(-1), torch.ones(idx.numel(), device=logits.device))
            f = counts / idx.numel()
            total = total + num_experts * (f * probs.mean(0)).sum()
        return total / len(self.logits)


def autocast_ctx(device, enabled=True):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def lm_loss(model, batch):
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def sample_batch(stream, args, gen, device):
    starts = torch.randint(0, stream.numel() - args.seq - 1, (args.batch,), generator=gen)
    idx = starts[:, None] + torch.arange(args.seq + 1)[None, :]
    return stream[idx].to(device, non_blocking=True)


def pick_experts_impl(model, tap, stream, args, gen, device, cfg):
    """Times one forward+backward with each implementation transformers offers and keeps the faster.

    grouped_mm runs the experts in the weights' dtype (float32 here, it is not autocast-enabled);
    eager loops over experts in bf16 under autocast. Which wins depends on the GPU and torch build,
    and grouped_mm may not support float32 at all on some builds: measuring settles both.
    """
    cands = ["grouped_mm", "eager"] if args.experts_impl == "auto" else [args.experts_impl]
    timings = {}
    batch = sample_batch(stream, args, gen, device)
    for impl in cands:
        try:
            model.set_experts_implementation(impl)
            times = []
            for _ in range(3):  # first is warm-up
                tap.clear()
                sync(device)
                t = time.perf_counter()
                with autocast_ctx(device):
                    loss = lm_loss(model, batch) + args.aux_coef * tap.balance_loss(cfg.n_routed_experts,
                                                                                    cfg.num_experts_per_tok)
                loss.backward()
                sync(device)
                times.append(time.perf_counter() - t)
            timings[impl] = min(times[1:])
            log(f"experts implementation {impl}: {timings[impl] * 1e3:.0f} ms per forward+backward")
        except Exception as e:  # an unsupported dtype or kernel on this build: skip it
            log(f"experts implementation {impl} failed: {type(e).__name__}: {str(e)[:200]}")
        finally:
            model.zero_grad(set_to_none=True)
            tap.clear()
    if not timings:
        raise SystemExit("no experts implementation ran")
    best = min(timings, key=timings.get)
    model.set_experts_implementation(best)
    return best, timings


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Evaluation and routing statistics

class RoutingStats:
    def __init__(self, n_layers, num_experts, top_k):
        self.E, self.k = num_experts, top_k
        self.counts = [torch.zeros(num_experts, dtype=torch.float64) for _ in range(n_layers)]
        self.same_set = [0] * n_layers
        self.overlap = [0.0] * n_layers
        self.pairs = 0
        self.unique = [0.0] * n_layers
        self.windows = 0

    def add(self, topk_per_layer, batch, seq):
        for li, idx in enumerate(topk_per_layer):
            idx = idx.reshape(batch, seq, self.k).cpu()
            mask = torch.zeros(batch, seq, self.E, dtype=torch.bool).scatter_(2, idx, True)
            self.counts[li] += mask.sum((0, 1)).double()
            both = (mask[:, 1:] & mask[:, :-1]).sum(-1)
            self.same_set[li] += int((both == self.k).sum())
            self.overlap[li] += float(both.sum()) / self.k
            w = seq // WINDOW
            if w:
                self.unique[li] += float(mask[:, : w * WINDOW].reshape(batch, w, WINDOW, self.E).any(2).sum())
        self.pairs += batch * (seq - 1)
        self.windows += batch * (seq // WINDOW)

    def report(self, layer_ids):
        E, k = self.E, self.k
        layers = []
        for li, lid in enumerate(layer_ids):
            p = self.counts[li] / self.counts[li].sum()
            nz = p[p > 0]
            ent = float(-(nz * nz.log()).sum())
            layers.append({
                "layer": lid,
                "load_entropy_nats": round(ent, 4),
                "load_entropy_over_uniform": round(ent / math.log(E), 4),
                "top16_share": round(float(p.sort(descending=True).values[:16].sum()), 4),
                "max_load_over_mean": round(float(p.max()) * E, 3),
                "unused_experts": int((p == 0).sum()),
                "same_set_as_previous": round(self.same_set[li] / max(self.pairs, 1), 4),
                "overlap_with_previous": round(self.overlap[li] / max(self.pairs, 1), 4),
                "unique_experts_per_17": round(self.unique[li] / max(self.windows, 1), 2),
            })
        comb = math.comb(E, k)
        uniform = {
            "load_entropy_nats": round(math.log(E), 4),
            "top16_share": round(min(16, E) / E, 4),
            "same_set_as_previous": 1.0 / comb,
            "overlap_with_previous": round(k / E, 4),
            "unique_experts_per_17": round(E * (1 - (1 - k / E) ** WINDOW), 2),
        }
        return {"layers": layers, "uniform": uniform, "tokens": int(self.counts[0].sum()) // k}


@torch.no_grad()
def evaluate(model, tap, held, args, device, use_autocast, stats=None):
    """Mean next-token cross-entropy over non-overlapping held-out windows."""
    n_win = min((held.numel() - 1) // args.seq, max(1, args.eval_tokens // args.seq))
    if n_win < 1:
        raise SystemExit("held-out text shorter than one sequence: raise --max-bytes or --heldout")
    total, count = 0.0, 0
    tap.keep_logits = False
    for b0 in range(0, n_win, args.batch):
        starts = torch.arange(b0, min(b0 + args.batch, n_win)) * args.seq
        batch = held[starts[:, None] + torch.arange(args.seq + 1)[None, :]].to(device)
        tap.clear()
        with autocast_ctx(device, enabled=use_autocast):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum")
        total += float(ce)
        count += batch[:, 1:].numel()
        if stats is not None:
            stats.add(tap.topk, batch.size(0), args.seq)
    tap.clear()
    tap.keep_logits = True
    return total / count, count


# ---------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; pass --device cpu (with --tiny) for a smoke test")
    budget_s = args.minutes * 60
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # TF32 for any float32 matmul (grouped_mm runs in float32)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    if args.tiny:
        log("--tiny: shrunk widths for a smoke test; this checkpoint says nothing about Specter's speed")

    # Corpus and tokenizer.
    roots, n_found, train_texts, held_texts, n_bytes = load_corpus(args)
    log(f"corpus: {len(train_texts)} train + {len(held_texts)} held-out files, {n_bytes / 1e6:.1f} MB "
        f"({n_found} .py files found under {len(roots)} root(s))")
    if not held_texts or not train_texts:
        raise SystemExit("corpus too small for a held-out split: raise --max-bytes or --heldout")
    tok = build_tokenizer(train_texts, args.vocab, args.tokenizer_mb)
    vocab = tok.get_vocab_size()
    train = encode_stream(tok, train_texts)
    held = encode_stream(tok, held_texts)
    del train_texts, held_texts
    log(f"tokenizer: byte-level BPE, {vocab} tokens; train {train.numel():,} tokens, held-out {held.numel():,} "
        f"({n_bytes / (train.numel() + held.numel()):.2f} bytes per token)")
    if train.numel() <= args.seq + 1:
        raise SystemExit("training text shorter than one sequence")
    if device.type == "cuda":
        train = train.to(device)  # batches are gathered on the device

    # Model.
    cfg = model_config(args, vocab)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    log(f"model: DeepSeek-V2, {args.layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts "
        f"x {cfg.moe_intermediate_size} top-{cfg.num_experts_per_tok}, {n_params / 1e9:.3f} B parameters "
        f"({n_expert / 1e9:.3f} B in routed experts)")
    tap = RouterTap(model)
    moe_layer_ids = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    impl, impl_times = pick_experts_impl(model, tap, train, args, gen, device, cfg)
    log(f"training with experts implementation {impl}")

    # Training: the learning rate warms up by steps, then follows a cosine over the time budget
    # (the number of steps is not known in advance), down to a tenth of the peak.
    t_train = time.time()
    step, tokens = 0, 0
    acc_ce, acc_aux, acc_n = torch.zeros((), device=device), torch.zeros((), device=device), 0
    step_s = None
    history = []
    while True:
        now = time.time()
        if step_s is not None and now - T_START + 1.5 * step_s > budget_s:
            break
        if step_s is None and now - T_START > budget_s:
            break
        frac = min(1.0, (now - t_train) / max(1.0, budget_s - (t_train - T_START)))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        batch = sample_batch(train, args, gen, device)
        tap.clear()
        with autocast_ctx(device):
            ce = lm_loss(model, batch)
            aux = tap.balance_loss(cfg.n_routed_experts, cfg.num_experts_per_tok)
            loss = ce + args.aux_coef * aux
        loss.backward()
        tap.clear()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += args.batch * args.seq
        acc_ce += ce.detach()
        acc_aux += aux.detach()
        acc_n += 1
        dt = time.time() - t0
        step_s = dt if step_s is None else 0.9 * step_s + 0.1 * dt
        if step % args.log_every == 0:
            ce_m, aux_m = float(acc_ce) / acc_n, float(acc_aux) / acc_n
            el = time.time() - t_train
            log(f"step {step:5d}  loss {ce_m:.4f}  balance {aux_m:.4f}  lr {lr:.2e}  "
                f"{tokens / el:,.0f} tok/s  epochs {tokens / train.numel():.2f}")
            history.append({"step": step, "loss": round(ce_m, 4), "balance": round(aux_m, 4),
                            "seconds": round(el, 1)})
            acc_ce.zero_()
            acc_aux.zero_()
            acc_n = 0
    sync(device)
    train_s = time.time() - t_train
    log(f"training done: {step} steps, {tokens:,} tokens in {train_s:.1f} s ({tokens / max(train_s, 1e-9):,.0f} tok/s)")
    if step == 0:
        raise SystemExit("no training step fitted in --minutes")

    # Held-out evaluation: the float32 master weights under autocast, then the float16 weights
    # that are saved (what the runtime reads), with routing statistics from the latter.
    del opt
    model.eval()
    model.set_experts_implementation("eager")  # grouped_mm may not take float16 on every build
    loss_master, n_eval = evaluate(model, tap, held, args, device, use_autocast=True)
    model.to(torch.float16)
    stats = RoutingStats(len(moe_layer_ids), cfg.n_routed_experts, cfg.num_experts_per_tok)
    loss_fp16, _ = evaluate(model, tap, held, args, device, use_autocast=False, stats=stats)
    routing = stats.report(moe_layer_ids)
    log(f"held-out: {n_eval:,} tokens, loss {loss_master:.4f} nats/token (ppl {math.exp(loss_master):.2f}) "
        f"with bf16 autocast; float16 weights: loss {loss_fp16:.4f} (ppl {math.exp(min(loss_fp16, 50)):.2f})")
    u = routing["uniform"]
    print(f"routing on {routing['tokens']:,} held-out tokens (uniform routing in the last row):", flush=True)
    print(f"{'layer':>5} {'H/ln64':>7} {'top16':>6} {'max/mean':>8} {'unused':>6} {'same_set':>8} "
          f"{'overlap':>7} {'uniq/17':>7}")
    for r in routing["layers"]:
        print(f"{r['layer']:>5} {r['load_entropy_over_uniform']:>7.3f} {r['top16_share']:>6.3f} "
              f"{r['max_load_over_mean']:>8.2f} {r['unused_experts']:>6d} {r['same_set_as_previous']:>8.4f} "
              f"{r['overlap_with_previous']:>7.3f} {r['unique_experts_per_17']:>7.2f}")
    print(f"{'unif':>5} {1.0:>7.3f} {u['top16_share']:>6.3f} {1.0:>8.2f} {0:>6d} {u['same_set_as_previous']:>8.1e} "
          f"{u['overlap_with_previous']:>7.3f} {u['unique_experts_per_17']:>7.2f}", flush=True)

    # Save: float16 safetensors, the tokenizer, and the report.
    t_save = time.time()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    report = {
        "script": "scripts/train_routed_moe.py",
        "tiny": args.tiny,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {"layers": args.layers, "hidden": cfg.hidden_size, "experts": cfg.n_routed_experts,
                  "expert_inter": cfg.moe_intermediate_size, "top_k": cfg.num_experts_per_tok,
                  "vocab": vocab, "parameters": n_params, "routed_expert_parameters": n_expert},
        "corpus": {"roots": len(roots), "bytes": n_bytes, "train_tokens": int(train.numel()),
                   "heldout_tokens": int(held.numel())},
        "experts_impl": impl,
        "experts_impl_ms": {k: round(v * 1e3, 1) for k, v in impl_times.items()},
        "steps": step,
        "train_tokens_seen": tokens,
        "epochs": round(tokens / train.numel(), 3),
        "train_seconds": round(train_s, 1),
        "loss_history": history,
        "heldout": {"tokens": n_eval, "loss": round(loss_master, 4), "ppl": round(math.exp(loss_master), 3),
                    "loss_fp16": round(loss_fp16, 4)},
        "routing": routing,
    }
    report["save_seconds"] = round(time.time() - t_save, 1)
    report["wall_seconds"] = round(time.time() - T_START, 1)
    with open(os.path.join(args.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(f"saved {args.out} (float16) in {report['save_seconds']} s; total wall {report['wall_seconds']} s")


if __name__ == "__main__":
    main()
