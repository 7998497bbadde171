"""Build the project's small base model offline: tokenizer, Llama weights, pre-training.

``build_model()`` returns ``cache_dir/<build_key>/``, a Hugging Face model folder that
transformers and vLLM both load (``config.json``, ``model.safetensors`` in float32,
tokenizer with its chat template, ``generation_config.json``), plus the sidecar
``flywheel_model.json``. The build key hashes the settings and ``BUILDER_VERSION``;
a finished build is reused at once. Folders appear atomically (temp dir, fsync, rename).

Pre-training is brief supervised learning on demonstrations of the calculator task
drawn from the TRAIN split: a mixture of correct trajectories and flawed ones
(guessing without the tool, a wrong operand or operator, a mis-copied result), so the
base policy has every skill but picks the right behaviour only part of the time.
Reward alone can then shift that mixture (see docs/task.md).

Calibration: float kernels differ between CPUs (AVX2 against AVX-512), so the same seed
does not give the same weights on every machine, and whether so small a model learns to
copy digits within the pre-training budget is a sudden, all-or-nothing event. The same
settings gave 27 % held-out success on one machine and 5 % on another. A base model that
never copies correctly gives reward almost nothing to work with, so a build whose
success on a *calibration* set (held-out problems drawn with their own seed, not the
gate's) falls outside ``CALIBRATION_BAND`` is pre-trained again from the next attempt
seed, up to ``CALIBRATION_ATTEMPTS`` times; the attempt nearest the band is kept. Every
attempt is recorded in the sidecar.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from flywheel.core.fsutil import fsync_dir, fsync_tree
from flywheel.core.settings import ModelSettings, get_settings
from flywheel.model.check import hash_files, hashed_files, policy_version_for, weight_files
from flywheel.model.eval import DEFAULT_EVAL_SEED, load_policy
from flywheel.model.tasks import build_task
from flywheel.model.tokenizer import ROLES, train_tokenizer
from flywheel.task import arith

# torch and transformers are imported inside the functions that train and save: serving and the trainer
# import this module for its cache helpers (build_key, is_complete, read_sidecar, build_model of a built key)
# and must not load them for that.
if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

BUILDER_VERSION = "4"
"""Bump when anything that changes the built weights changes (corpus, recipe, format)."""
SIDECAR_NAME = "flywheel_model.json"
SIDECAR_SCHEMA_VERSION = 1
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", SIDECAR_NAME)

MAX_POSITIONS = 256
INTERMEDIATE_MULT = 2
BATCH_SIZE = 64
MICRO_BATCH = 16
LEARNING_RATE = 3e-3
WARMUP_STEPS = 30
GRAD_CLIP = 1.0
TOKENIZER_CORPUS_CHATS = 4000
EVAL_N = 200
EVAL_TEMPERATURE = 1.0
TORCH_THREADS = 2
CALIBRATION_BAND = (0.15, 0.50)
"""Calibration success a base model must reach (every skill present) and not exceed (room to learn)."""
CALIBRATION_ATTEMPTS = 3
CALIBRATION_SEED = 4321
"""Seed of the calibration problems (held-out problems, distinct from the gate's ``DEFAULT_EVAL_SEED`` draw)."""
ATTEMPT_SEED_STRIDE = 7919

MIXTURE: dict[arith.Behaviour, float] = {
    arith.Behaviour.CORRECT: 0.30,
    arith.Behaviour.GUESS: 0.36,
    arith.Behaviour.WRONG_OPERAND: 0.15,
    arith.Behaviour.WRONG_OP: 0.06,
    arith.Behaviour.MISCOPY: 0.09,
    arith.Behaviour.MALFORMED_RETRY: 0.04,
}
"""Share of each behaviour in the pre-training corpus; 34 % of demonstrations succeed."""


class BuildError(RuntimeError):
    """The model could not be built (not recoverable by retrying with the same settings)."""


class PretrainSummary(BaseModel):
    """How the weights were pre-trained."""

    steps: int
    batch_size: int
    learning_rate: float
    sequences: int
    final_loss: float | None
    """Mean assistant-token loss over the last 50 steps (None when steps == 0)."""
    seconds: float


class HeldoutSummary(BaseModel):
    """Held-out success of the built model, as measured at build time."""

    success_rate: float
    n: int
    temperature: float
    seed: int
    by_kind: dict[str, float]
    tool_call_rate: float


class CalibrationAttempt(BaseModel):
    """One pre-training attempt of a build and its calibration success."""

    attempt: int
    seed: int
    """Seed of the initialisation and the data order of this attempt."""
    calibration_success: float
    final_loss: float | None
    chosen: bool = False


class ModelSidecar(BaseModel):
    """``flywheel_model.json``: what was built, from what, and how good it is."""

    schema_version: int = SIDECAR_SCHEMA_VERSION
    builder_version: str = BUILDER_VERSION
    task_version: str = arith.TASK_VERSION
    build_key: str
    policy_version: str
    """Policy version of the base weights, ``base-<12 hex of the content hash>`` (:mod:`flywheel.model.check`)."""
    seed: int
    settings: dict[str, Any]
    """The ModelSettings the build key was computed from."""
    versions: dict[str, str] = Field(default_factory=dict)
    """torch and transformers versions that built the weights."""
    config: dict[str, Any]
    """The model's LlamaConfig as a dict."""
    param_count: int
    tokenizer_vocab: int
    mixture: dict[str, float]
    pretrain: PretrainSummary
    heldout: HeldoutSummary
    calibration: list[CalibrationAttempt] = Field(default_factory=list)
    """Every pre-training attempt (see the module docstring); the chosen one is marked."""
    build_seconds: float
    created_at: str


@dataclass
class Corpus:
    """Tokenised demonstrations: one id list and one loss mask per chat."""

    ids: list[list[int]]
    masks: list[list[int]]


# --------------------------------------------------------------------------- cache


def build_key(settings: ModelSettings) -> str:
    """Hash of everything that determines the built weights (not where they are cached)."""
    payload = settings.model_dump(mode="json", exclude={"cache_dir", "path", "completion_only", "task"})
    payload |= {"builder_version": BUILDER_VERSION, "task_version": build_task(settings.task).version}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds every file of a finished build."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def read_sidecar(folder: Path | str) -> ModelSidecar:
    """The sidecar of a built model folder."""
    return ModelSidecar.model_validate_json((Path(folder) / SIDECAR_NAME).read_text())


def build_model(settings: ModelSettings | None = None, force: bool = False) -> Path:
    """The folder of the base model for ``settings``, building it if needed.

    A finished build in ``cache_dir/<build_key>/`` is returned at once unless
    ``force``. Raises :class:`BuildError` when the build fails.
    """
    settings = settings or get_settings().model
    key = build_key(settings)
    cache_dir = Path(settings.cache_dir).resolve()
    target = cache_dir / key
    if is_complete(target) and not force:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache_dir, key):
        if is_complete(target) and not force:
            return target  # another process built it while this one waited
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=cache_dir))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published folder is shared
        try:
            try:
                _build_into(tmp, settings, key)
            except BuildError:
                raise
            except Exception as exc:  # turn any failure into one clear error, then re-raise
                raise BuildError(f"building model {key} failed: {type(exc).__name__}: {exc}") from exc
            fsync_tree(tmp)
            return _publish(tmp, target, force)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _build_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """Hold ``cache_dir/.build-<key>.lock``: a second process building the same key waits for the first
    (then finds its build) instead of spending a core on the same work. Released when the process dies."""
    with open(cache_dir / f".build-{key}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building model %s; waiting for it", key)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(tmp: Path, target: Path, force: bool) -> Path:
    """Rename the finished ``tmp`` into place; an existing build is replaced only if ``force``."""
    if target.exists():
        if not force and is_complete(target):
            return target  # another process finished first; its build is equivalent
        trash = target.with_name(f".trash-{target.name}-{os.getpid()}")
        os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if is_complete(target):
            return target  # lost a race with a concurrent build of the same key
        raise
    fsync_dir(target.parent)
    return target


# --------------------------------------------------------------------------- build steps


def _build_into(folder: Path, settings: ModelSettings, key: str) -> None:
    """Build tokenizer and model into ``folder`` (calibrated), measure it, and write the sidecar."""
    import torch
    import transformers

    started = time.perf_counter()
    task = build_task(settings.task)
    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        pretrain, attempts = _calibrated_pretrain(folder, settings)
        model, tokenizer = load_policy(folder)  # measure what was saved, not what is in memory
        result = task.evaluate(model, tokenizer, n=EVAL_N, seed=DEFAULT_EVAL_SEED, temperature=EVAL_TEMPERATURE)
    finally:
        torch.set_num_threads(threads)
    sidecar = ModelSidecar(
        build_key=key,
        policy_version=policy_version_for(hash_files(folder, hashed_files(folder, weight_files(folder)))),
        seed=settings.seed,
        settings=settings.model_dump(mode="json", exclude={"path", "completion_only"}),
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
        config=model.config.to_dict(),
        param_count=sum(p.numel() for p in model.parameters()),
        tokenizer_vocab=len(tokenizer),
        task_version=task.version,
        mixture=task.mixture or {b.value: w for b, w in MIXTURE.items()},
        pretrain=pretrain,
        heldout=HeldoutSummary(
            success_rate=result.success_rate,
            n=result.n,
            temperature=result.temperature,
            seed=result.seed,
            by_kind=result.by_kind,
            tool_call_rate=result.tool_call_rate,
        ),
        calibration=attempts,
        build_seconds=round(time.perf_counter() - started, 2),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    (folder / SIDECAR_NAME).write_text(sidecar.model_dump_json(indent=2) + "\n")


def _band_distance(success: float) -> float:
    low, high = CALIBRATION_BAND
    return max(low - success, success - high, 0.0)


def _calibrated_pretrain(folder: Path, settings: ModelSettings) -> tuple[PretrainSummary, list[CalibrationAttempt]]:
    """Pre-train into ``folder`` until the calibration success lies in the band (see the module docstring)."""
    attempts: list[CalibrationAttempt] = []
    summaries: list[PretrainSummary] = []
    for attempt in range(CALIBRATION_ATTEMPTS):
        seed = settings.seed + ATTEMPT_SEED_STRIDE * attempt
        target = folder / f".attempt-{attempt}"
        summaries.append(_train_and_save(target, settings, seed))
        model, tokenizer = load_policy(target)
        success = (
            build_task(settings.task)
            .evaluate(model, tokenizer, n=EVAL_N, seed=CALIBRATION_SEED, temperature=EVAL_TEMPERATURE)
            .success_rate
        )
        attempts.append(CalibrationAttempt(attempt=attempt, seed=seed, calibration_success=success,
                                           final_loss=summaries[-1].final_loss))  # fmt: skip
        log.info("calibration attempt %d (seed %d): success %.1f%%, band %s", attempt, seed, 100 * success,
                 CALIBRATION_BAND)  # fmt: skip
        if _band_distance(success) == 0.0:
            break
    best = min(attempts, key=lambda a: (_band_distance(a.calibration_success), a.attempt))
    if _band_distance(best.calibration_success) > 0.0:
        log.warning("no pre-training attempt reached the calibration band %s; keeping attempt %d (%.1f%%)",
                    CALIBRATION_BAND, best.attempt, 100 * best.calibration_success)  # fmt: skip
    chosen = folder / f".attempt-{best.attempt}"
    for item in chosen.iterdir():
        item.rename(folder / item.name)
    for attempt in attempts:
        shutil.rmtree(folder / f".attempt-{attempt.attempt}", ignore_errors=True)
    marked = [a.model_copy(update={"chosen": a.attempt == best.attempt}) for a in attempts]
    return summaries[best.attempt], marked


def _train_and_save(folder: Path, settings: ModelSettings, seed: int) -> PretrainSummary:
    """Corpus and tokenizer (fixed by ``settings.seed``), initialisation and pre-training (by ``seed``), saved."""
    import torch

    task = build_task(settings.task)
    rng = random.Random(f"flywheel-corpus:{settings.seed}")
    tokenizer_chats = task.demonstrations(TOKENIZER_CORPUS_CHATS, rng)
    tokenizer = train_tokenizer(
        (m["content"] for chat in tokenizer_chats for m in chat), settings.vocab_size, task.max_positions
    )
    n_sequences = max(settings.pretrain_steps * BATCH_SIZE, 1)
    corpus = tokenize_corpus(tokenizer, task.demonstrations(n_sequences, rng), task.max_positions)
    torch.manual_seed(seed)
    model = init_model(settings, tokenizer, task.max_positions)
    pretrain = pretrain_model(model, corpus, settings.pretrain_steps, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_folder(model, tokenizer, folder, task.max_new_tokens)
    return pretrain


def demonstrations(n: int, rng: random.Random) -> list[list[arith.Message]]:
    """``n`` calculator chats on TRAIN problems, behaviours drawn from :data:`MIXTURE`."""
    return build_task("arith").demonstrations(n, rng)


def tokenize_corpus(
    tokenizer: PreTrainedTokenizerFast, chats: list[list[arith.Message]], max_positions: int = MAX_POSITIONS
) -> Corpus:
    """Token ids and assistant-token loss masks of every chat (one batched encode)."""
    contents = [m["content"] for chat in chats for m in chat]
    encoded = iter(tokenizer(contents, add_special_tokens=False)["input_ids"])
    bos, eot = tokenizer.bos_token_id, tokenizer.eos_token_id
    role_ids = {role: tokenizer.convert_tokens_to_ids(f"<|{role}|>") for role in ROLES}
    corpus = Corpus(ids=[], masks=[])
    for chat in chats:
        ids, mask = [bos], [0]
        for message in chat:
            content = next(encoded)
            trained = int(message["role"] == "assistant")
            ids += [role_ids[message["role"]], *content, eot]
            mask += [0] + [trained] * (len(content) + 1)
        if len(ids) > max_positions:
            raise BuildError(f"demonstration of {len(ids)} tokens exceeds {max_positions} positions")
        corpus.ids.append(ids)
        corpus.masks.append(mask)
    return corpus


def init_model(
    settings: ModelSettings, tokenizer: PreTrainedTokenizerFast, max_positions: int = MAX_POSITIONS
) -> LlamaForCausalLM:
    """A freshly initialised float32 Llama sized by ``settings`` (seed torch first)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = settings.hidden_size // settings.num_heads
    if head_dim < 64:
        raise BuildError(f"head_dim {head_dim} < 64: vLLM's CPU attention rejects it")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.hidden_size * INTERMEDIATE_MULT,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    return model


def pretrain_model(model: LlamaForCausalLM, corpus: Corpus, steps: int, seed: int) -> PretrainSummary:
    """Supervised training on assistant tokens: AdamW, warm-up then cosine decay.

    Each step takes ``BATCH_SIZE`` random chats; they are sorted by length and run in
    micro-batches, so the rare long (three-turn) chats do not pad the whole batch.
    The loss is the mean over every assistant token of the batch.
    """
    import torch

    started = time.perf_counter()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    order = list(range(len(corpus.ids)))
    random.Random(f"flywheel-order:{seed}").shuffle(order)
    losses: list[float] = []
    for step in range(steps):
        rows = [order[(step * BATCH_SIZE + i) % len(order)] for i in range(BATCH_SIZE)]
        rows.sort(key=lambda r: len(corpus.ids[r]))
        n_tokens = sum(sum(corpus.masks[r]) for r in rows)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(rows), MICRO_BATCH):
            loss = _token_loss_sum(model, *_batch(corpus, rows[i : i + MICRO_BATCH])) / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        schedule.step()
        losses.append(total)
        if step % 100 == 0 or step == steps - 1:
            log.info("pretrain step %d/%d loss %.4f", step + 1, steps, total)
    model.eval()
    tail = losses[-50:]
    return PretrainSummary(
        steps=steps,
        batch_size=BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        sequences=len(corpus.ids),
        final_loss=round(sum(tail) / len(tail), 5) if tail else None,
        seconds=round(time.perf_counter() - started, 2),
    )


def _token_loss_sum(
    model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    """Summed next-token cross-entropy over the labelled (assistant) tokens."""
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
    targets = labels[:, 1:].reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=-100, reduction="sum")


def _lr_factor(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(steps - WARMUP_STEPS, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _batch(corpus: Corpus, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, labels (-100 outside assistant tokens) and attention mask."""
    import torch

    width = max(len(corpus.ids[r]) for r in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids, mask = corpus.ids[r], corpus.masks[r]
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    return input_ids, labels, attention


def save_folder(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path, max_new_tokens: int = 32
) -> None:
    """Write weights (safetensors, float32), tokenizer and generation config to ``folder``."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if not (folder / "model.safetensors").is_file():
        raise BuildError(f"save_pretrained wrote no model.safetensors in {folder}")
