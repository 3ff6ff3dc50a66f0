"""Flow-GRPO / DanceGRPO training of a diffusion transformer, in one process: sample, score, update.

One iteration (:meth:`FlowGRPORun.iteration`):

1. draw ``prompts_per_iteration`` training captions and ``group_size`` noises each;
2. sample them along the SDE (:class:`~mindspeed_rl.models.dit_policy.DiTPolicy`, guidance included),
   recording each step's log-probability; decode with the pipeline's VAE; score with the registered image
   reward (:mod:`mindspeed_rl.rewards.image`);
3. advantages clipped to ``[-adv_clip, adv_clip]``: Flow-GRPO's per-prompt stat tracking
   (:func:`~mindspeed_rl.algorithms.flow_grpo.per_prompt_advantages`, ``advantage: per_prompt``, with the
   round's std when ``global_std``) or a registered group estimator (``grpo``, ...,
   :mod:`mindspeed_rl.algorithms.advantages`);
4. draw the trained steps (``timestep_fraction`` of them, :func:`~mindspeed_rl.algorithms.flow_grpo.select_steps`)
   and take ``mini_batches`` AdamW steps over the samples, each on the clipped objective of
   :func:`~mindspeed_rl.algorithms.flow_grpo.flow_grpo_loss` (the later mini-batches are off-policy by the
   earlier steps, where the clip acts), with the KL of the step means to the frozen start when ``kl_coef > 0``.

Every draw of iteration ``i`` comes from one generator seeded by ``(seed, i)``, so a run stopped after any
iteration and resumed from its state file (the weights, AdamW's state and the iteration, saved to a
temporary name then renamed) continues as the uninterrupted run does. The held-out check
(:meth:`FlowGRPORun.evaluate`) samples the demo's held-out captions with the ODE (Euler, as the demo's
learning check does) and scores colour and position.

The demo (``demo``: :mod:`~mindspeed_rl.driver.flow_grpo_demos`) sets the captions, the sample size and the
checks: ``t2i`` (tiny FLUX, images) or ``t2v`` (tiny Wan, video latents ``[B, C, F, H, W]``, colour and direction).
With ``lora_target_modules`` the policy is LoRA-adapted (:mod:`~mindspeed_rl.models.dit_lora`): AdamW gets the
factors only, the KL reference is the model with its adapters off, the state file holds the factors.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed_mm.demos.scene import COLOURS, SHAPES
from mindspeed_mm.demos.t2i import POSITIONS, caption, heldout_combinations
from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents
from mindspeed_mm.inference.dit_pipeline import latent_shape, load_dit_pipeline
from mindspeed_rl.algorithms.advantages import ADVANTAGES, compute_advantages
from mindspeed_rl.algorithms.flow_grpo import (
    STEP_SELECTIONS,
    flow_grpo_loss,
    gaussian_kl,
    per_prompt_advantages,
    select_steps,
)
from mindspeed_rl.algorithms.losses import policy_loss_config
from mindspeed_rl.driver.flow_grpo_demos import FLOW_GRPO_DEMOS
from mindspeed_rl.models.dit_lora import (
    AdapterOffPolicy,
    adapter_state,
    apply_policy_lora,
    load_adapter_state,
    merged_transformer,
    policy_lora_config,
    trainable_parameters,
)
from mindspeed_rl.models.dit_policy import DiTPolicy, PromptBatch, schedule
from mindspeed_rl.rewards import video as _video_rewards  # noqa: F401  (registers the video rewards)
from mindspeed_rl.rewards.image import build_image_reward

logger = get_logger(__name__)
STATE_FILE = "flow_grpo_state.pt"


@dataclass(frozen=True)
class FlowGRPOConfig:
    """A Flow-GRPO run on the text-to-image shapes demo (defaults: Flow-GRPO's settings where they apply).

    Attributes:
        load_dir: the starting transformer (a diffusers directory: the demo's SFT export).
        pipeline_dir: its pipeline (VAE, text encoders, scheduler); None: the demo's.
        reward: a key of :data:`~mindspeed_rl.rewards.image.IMAGE_REWARDS`.
        iterations: sample-score-update rounds.
        prompts_per_iteration / group_size: captions per round and samples per caption.
        mini_batches: optimizer steps per round (the samples split evenly).
        sampling_steps: denoising steps of a sample.
        noise_level: the SDE's ``a`` (Flow-GRPO 0.7).
        guidance_scale: classifier-free guidance in sampling and training (1: none).
        timestep_fraction / step_selection: the share of steps trained on, ``random`` (DanceGRPO) or ``first``.
        clip_eps: the ratio clip (Flow-GRPO and DanceGRPO: 1e-4; log-probs are per-element means).
        advantage: ``per_prompt`` (Flow-GRPO's per-prompt stat tracking) or a key of
            :data:`~mindspeed_rl.algorithms.advantages.ADVANTAGES` (``grpo``: group mean and sample std).
        global_std: with ``per_prompt``, divide by the std of the whole round (Flow-GRPO's default) rather
            than the prompt's.
        same_noise: the samples of a caption start from one noise (DanceGRPO; Flow-GRPO's ``same_latent``);
            they differ by the SDE's noise only.
        adv_clip: advantages are clipped to ``[-adv_clip, adv_clip]`` (Flow-GRPO: 5).
        kl_coef: weight of the KL of the step means to the starting policy (Flow-GRPO: 0.04; 0: none).
        lr / weight_decay / clip_grad: AdamW and the gradient-norm clip (0: none).
        seed: seeds every draw (per iteration).
        text_len: text tokens (the demo's 10).
        eval_seeds / eval_steps / eval_guidance: the held-out check's samples per caption, Euler steps, guidance.
        demo: the captions, sample size and checks (:data:`~mindspeed_rl.driver.flow_grpo_demos.FLOW_GRPO_DEMOS`:
            ``t2i``, the FLUX shapes demo; ``t2v``, the Wan text-to-video demo, with ``text_len: 8``).
        lora_rank / lora_alpha / lora_target_modules: LoRA on the transformer (``mindspeed-mm train``'s
            ``lora.r`` / ``lora.alpha`` / ``lora.target_modules``; ``[default]``: the family's attention
            projections); empty targets: full weights. Only the factors train; the KL reference is the model with
            its adapters off; the state file holds the factors and AdamW's state.
        export_dir: at the end, the transformer (LoRA merged into its weights) as a diffusers directory here.
        eval_train_seeds: the check samples each of the 40 training captions from this many noises as well
            (seeds 0, 1, ...; keys ``train_*``; 0: not).
        sde_window_size / sde_window_range: Flow-GRPO-Fast's (and MixGRPO's) window: with a size ``> 0`` only
            that many consecutive steps are SDE steps, the others the ODE's (Euler), and only the window's steps
            are trained on (``timestep_fraction`` / ``step_selection`` unused); each round draws the window's
            first step uniformly so that the window lies in ``[start, end)`` of the range (None: all the steps).
            0: every step is an SDE step (the default).
    """

    load_dir: str = "runs/mm-t2i-tiny-cpu/hf"
    pipeline_dir: str | None = None
    reward: str = "shapes"
    iterations: int = 20
    prompts_per_iteration: int = 8
    group_size: int = 4
    mini_batches: int = 2
    sampling_steps: int = 10
    noise_level: float = 0.7
    guidance_scale: float = 4.0
    timestep_fraction: float = 0.6
    step_selection: str = "random"
    clip_eps: float = 1e-4
    advantage: str = "per_prompt"
    global_std: bool = True
    same_noise: bool = False
    adv_clip: float = 5.0
    kl_coef: float = 0.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 0
    text_len: int = 10
    eval_seeds: int = 4
    eval_steps: int = 10
    eval_guidance: float = 4.0
    demo: str = "t2i"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_target_modules: list[str] = field(default_factory=list)
    export_dir: str | None = None
    eval_train_seeds: int = 0
    sde_window_size: int = 0
    sde_window_range: tuple[int, ...] | None = None

    def validate(self) -> None:
        """Raises ValueError naming the setting that is out of range."""
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: group-relative advantages need at least 2 samples")
        batch = self.prompts_per_iteration * self.group_size
        if self.mini_batches < 1 or batch % self.mini_batches:
            raise ValueError(f"mini_batches={self.mini_batches} must divide the {batch} samples of a round")
        if self.step_selection not in STEP_SELECTIONS:
            raise ValueError(f"step_selection={self.step_selection!r}; use one of {', '.join(STEP_SELECTIONS)}")
        if self.advantage != "per_prompt" and self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage={self.advantage!r}; use per_prompt or one of {', '.join(ADVANTAGES)}")
        if self.noise_level <= 0:
            raise ValueError(f"noise_level={self.noise_level} must be > 0 (the SDE's log-probs; 0.7 in Flow-GRPO)")
        FLOW_GRPO_DEMOS.get(self.demo)
        if self.lora_target_modules:
            policy_lora_config(self.lora_rank, self.lora_alpha, self.lora_target_modules)
        start, end = self.window_range()
        if self.sde_window_size < 0 or not 0 <= start <= start + self.sde_window_size <= end <= self.sampling_steps:
            raise ValueError(
                f"sde_window_size={self.sde_window_size} with sde_window_range={self.sde_window_range} must fit in "
                f"[0, sampling_steps={self.sampling_steps}): give e.g. sde_window_size=2 sde_window_range=[0,2]"
            )

    def window_range(self) -> tuple[int, int]:
        """The steps ``[start, end)`` the SDE window is drawn in (all the steps when ``sde_window_range`` is None)."""
        if self.sde_window_range is None:
            return 0, self.sampling_steps
        if len(self.sde_window_range) != 2:
            raise ValueError(f"sde_window_range={self.sde_window_range} must be two steps [start, end), e.g. [0, 2]")
        return int(self.sde_window_range[0]), int(self.sde_window_range[1])

    @property
    def lora(self) -> bool:
        """Whether the policy is LoRA-adapted."""
        return bool(self.lora_target_modules)


def training_captions() -> list[str]:
    """The demo's 40 training captions (every colour, shape and quadrant but the held-out combinations)."""
    held = set(heldout_combinations())
    return [caption(*c) for c in itertools.product(COLOURS, SHAPES, POSITIONS) if c not in held]


def check_policy_family(family: Any, model_config: Any, load_dir: str) -> None:
    """Refuse a transformer the policy cannot sample: one that takes image conditions (Wan I2V / FLF2V) or per-token
    timesteps (Wan2.2 TI2V); text-to-image and text-to-video ones (FLUX, Wan T2V, ...) pass.

    Raises:
        ValueError: naming ``load_dir``'s family and what Flow-GRPO takes.
    """
    if family.condition_keys(model_config) or family.timestep_tokens is not None or family.first_frame_condition:
        raise ValueError(
            f"load_dir={load_dir!r} is a {family.key} (image-conditioned or per-token timesteps): Flow-GRPO here "
            "samples text-to-image and text-to-video transformers only (FLUX, Wan T2V); give one of those"
        )


class FlowGRPORun:
    """The policy, its optimizer, the reference, the encoded captions and the iteration counter of one run."""

    def __init__(self, config: FlowGRPOConfig) -> None:
        config.validate()
        self.config = config
        self.demo = FLOW_GRPO_DEMOS.get(config.demo)
        pipeline = Path(config.pipeline_dir) if config.pipeline_dir else self.demo.pipeline()
        self.pipeline = pipeline
        loaded = load_dit_pipeline(config.load_dir, pipeline_dir=pipeline)
        self.family, self.parts, self.model = loaded.family, loaded.parts, loaded.model.train()
        check_policy_family(self.family, self.model.config, config.load_dir)
        self.device = next(self.model.parameters()).device
        self.lora = (
            policy_lora_config(config.lora_rank, config.lora_alpha, config.lora_target_modules) if config.lora else None
        )
        if self.lora is not None:  # the factors' random start from the run's seed (a resumed run loads them)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.seed)
                apply_policy_lora(self.model, self.family, self.lora)
        self.policy = DiTPolicy(self.model, self.family, config.noise_level, config.guidance_scale)
        self.reference = (
            DiTPolicy(copy.deepcopy(self.model).eval(), self.family, config.noise_level, config.guidance_scale)
            if config.kl_coef and self.lora is None
            else None
        )
        if config.kl_coef and self.lora is not None:  # the base: the same module with its adapters off, no copy
            self.reference = AdapterOffPolicy(self.model, self.family, config.noise_level, config.guidance_scale)
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(self.model), lr=config.lr, weight_decay=config.weight_decay
        )
        self.reward = build_image_reward(config.reward)
        d = self.demo
        self.shape = latent_shape(self.parts["vae"], self.family, d.frames, d.height, d.width)
        self.sigmas, self.timesteps = schedule(
            self.family, build_scheduler(self.family, pipeline), config.sampling_steps, (1, *self.shape)
        )
        self.captions = d.training_captions()
        self.text, self.pooled = self._encode(self.captions)
        self.negative, self.negative_pooled = self._encode([""])
        self.iteration_done = 0

    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            text, pooled = self.family.encode_prompts(self.parts, captions, self.config.text_len)
        return text.to(self.device), pooled.to(self.device) if pooled is not None else None

    def _prompts(self, text: torch.Tensor, pooled: torch.Tensor | None) -> PromptBatch:
        n = text.shape[0]
        negative_pooled = self.negative_pooled.expand(n, -1) if self.negative_pooled is not None else None
        return PromptBatch(text, pooled, self.negative.expand(n, -1, -1), negative_pooled)

    def iteration(self) -> dict[str, float]:
        """One sample-score-update round; returns its metrics (``reward``, ``colour``, ``position``, ``loss``, ...)."""
        c, it = self.config, self.iteration_done
        generator = torch.Generator().manual_seed(c.seed * 1_000_003 + it)
        chosen = torch.randperm(len(self.captions), generator=generator)[: c.prompts_per_iteration]
        rows = chosen.repeat_interleave(c.group_size)
        captions = [self.captions[i] for i in rows.tolist()]
        prompts = self._prompts(self.text[rows], self.pooled[rows] if self.pooled is not None else None)
        if c.same_noise:
            noise = torch.randn((len(chosen), *self.shape), generator=generator).repeat_interleave(c.group_size, 0)
        else:
            noise = torch.randn((len(rows), *self.shape), generator=generator)
        noise = noise.to(self.device)
        window = None
        if c.sde_window_size:
            start, end = c.window_range()
            first = int(torch.randint(start, end - c.sde_window_size + 1, (1,), generator=generator))
            window = torch.arange(first, first + c.sde_window_size)
        self.model.eval()
        trajectory = self.policy.sample(noise, prompts, self.sigmas, self.timesteps, generator, sde_steps=window)
        images = decode_latents(self.parts["vae"], trajectory.latents[:, -1])
        rewards = self.reward(images, captions).float()
        checks = self.demo.checks(images, captions)
        if c.advantage == "per_prompt":
            advantages = per_prompt_advantages(rewards, captions, c.global_std)
        else:
            advantages = compute_advantages(c.advantage, rewards, c.group_size)
        advantages = advantages.clamp(-c.adv_clip, c.adv_clip).to(self.device)
        if window is None:
            steps = select_steps(c.sampling_steps, c.timestep_fraction, generator, c.step_selection)
        else:
            steps = window
        order = torch.randperm(len(rows), generator=generator)
        loss_config = policy_loss_config("ppo_clip", kl_coef=0.0, clip_eps_low=c.clip_eps, clip_eps_high=c.clip_eps)
        self.model.train()
        sums: dict[str, float] = {}
        for part in order.chunk(c.mini_batches):
            batch = prompts.rows(part)
            log_probs, means, scales = self.policy.log_probs(trajectory, steps, batch, rows=part)
            kl = None
            if self.reference is not None:
                with torch.no_grad():
                    _, ref_means, _ = self.reference.log_probs(trajectory, steps, batch, rows=part)
                kl = torch.stack([gaussian_kl(means[:, k], ref_means[:, k], scales[k]) for k in range(len(steps))], 1)
            old = trajectory.log_probs[part][:, steps]
            out = flow_grpo_loss(log_probs, old, advantages[part], loss_config, kl=kl, kl_coef=c.kl_coef)
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            if c.clip_grad:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.clip_grad)
                out.metrics["grad_norm"] = norm.detach()
            self.optimizer.step()
            for key in ("loss", "pg_clipfrac", "ratio_mean", "approx_kl", "kl", "grad_norm"):
                if key in out.metrics:
                    sums[key] = sums.get(key, 0.0) + float(out.metrics[key]) / c.mini_batches
        self.iteration_done += 1
        record = {"iteration": self.iteration_done, "reward": float(rewards.mean()), **checks, **sums}
        if window is not None:
            record["sde_window_start"] = int(window[0])
        return record

    @torch.no_grad()
    def sample_checks(self, captions: list[str], seeds: int) -> dict[str, torch.Tensor]:
        """Per-sample ``reward``, ``colour`` and ``position`` (1 right, 0 wrong) ``[N]`` of ``captions`` (each
        ``seeds`` times in a row: seeds 0, 1, ...) sampled by Euler (the ODE) with ``eval_steps`` steps and
        guidance ``eval_guidance``, as the demo's learning check: the same noises at every check, so that two
        checks of one run are paired sample by sample."""
        c = self.config
        captions = [name for name in captions for _ in range(seeds)]
        text, pooled = self._encode(captions)
        noise = torch.stack(
            [torch.randn(self.shape, generator=torch.Generator().manual_seed(i % seeds)) for i in range(len(captions))]
        ).to(self.device)
        sigmas, timesteps = schedule(
            self.family, build_scheduler(self.family, self.pipeline), c.eval_steps, (1, *self.shape)
        )
        ode = DiTPolicy(self.model, self.family, noise_level=0.0, guidance_scale=c.eval_guidance)
        self.model.eval()
        latents = ode.sample(noise, self._prompts(text, pooled), sigmas, timesteps, torch.Generator()).latents[:, -1]
        images = decode_latents(self.parts["vae"], latents)
        checks = [self.demo.checks(image[None], [text]) for image, text in zip(images, captions)]
        return {
            "reward": self.reward(images, captions).float(),
            **{key: torch.tensor([float(r[key]) for r in checks]) for key in checks[0]},
        }

    def evaluate(self) -> dict[str, Any]:
        """The held-out check: the demo's held-out captions x ``eval_seeds`` (:meth:`sample_checks`): the demo's
        checks (t2i: colour and position accuracy; t2v: colour and direction), the run's reward with its standard
        error (``reward_se``) and every sample's values (``samples``, for paired differences: :func:`paired_gains`).
        With ``eval_train_seeds`` the same for the demo's training captions (keys ``train_*``)."""
        c = self.config
        groups = {"": (self.demo.heldout_captions(), c.eval_seeds)}
        if c.eval_train_seeds:
            groups["train_"] = (self.captions, c.eval_train_seeds)
        record: dict[str, Any] = {}
        for prefix, (names, seeds) in groups.items():
            values = self.sample_checks(names, seeds)
            for key, value in values.items():
                record[prefix + key] = float(value.mean())
            rewards = values["reward"]
            record[prefix + "reward_se"] = float(rewards.std() / len(rewards) ** 0.5) if len(rewards) > 1 else 0.0
            record[prefix + "samples"] = {key: value.tolist() for key, value in values.items()}
        return record

    def save(self, directory: Path) -> Path:
        """The weights, AdamW's state and the iteration into ``directory/flow_grpo_state.pt`` (written, then renamed)."""
        directory.mkdir(parents=True, exist_ok=True)
        path, tmp = directory / STATE_FILE, directory / (STATE_FILE + ".tmp")
        state = {
            "model": self.model.state_dict() if self.lora is None else adapter_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "iteration": self.iteration_done,
        }
        torch.save(state, tmp)
        tmp.replace(path)
        return path

    def load(self, path: Path) -> None:
        """Restore :meth:`save`'s state (tensors only: ``weights_only``)."""
        state = torch.load(path, map_location=self.device, weights_only=True)
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:
            load_adapter_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration_done = int(state["iteration"])

    def export(self, directory: str | Path) -> Path:
        """Write the transformer (LoRA merged: ``W + (alpha / r) B A``) as a diffusers directory (``config.json`` +
        safetensors: what ``from_pretrained`` and a pipeline's ``transformer`` folder load), written to a temporary
        name, then renamed."""
        target = Path(directory)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model = merged_transformer(self.model, self.family, self.lora) if self.lora is not None else self.model
        model.save_pretrained(str(tmp))
        shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
        return target


def paired_gains(start: dict[str, Any], later: dict[str, Any]) -> dict[str, float]:
    """The paired change of each per-sample value of two checks (:meth:`FlowGRPORun.evaluate` records of one run,
    the same samples' noises): ``{prefix}{key}_gain`` (mean of the differences) and ``{prefix}{key}_gain_se`` (their
    standard error, sample std over sqrt N) for ``reward``, ``colour`` and ``position``.

    Raises:
        ValueError: checks of different sample counts (not paired: another ``eval_seeds``).
    """
    gains: dict[str, float] = {}
    for prefix in ("", "train_"):
        before, after = start.get(prefix + "samples"), later.get(prefix + "samples")
        if before is None or after is None:
            continue
        for key in before:
            a, b = torch.tensor(before[key], dtype=torch.float64), torch.tensor(after[key], dtype=torch.float64)
            if a.shape != b.shape:
                raise ValueError(
                    f"{prefix}samples.{key}: {len(a)} samples before and {len(b)} after are not paired; "
                    "compare checks of one run (the same eval_seeds)"
                )
            diff = b - a
            gains[f"{prefix}{key}_gain"] = float(diff.mean())
            gains[f"{prefix}{key}_gain_se"] = float(diff.std() / len(diff) ** 0.5) if len(diff) > 1 else 0.0
    return gains


def train_flow_grpo(
    config: FlowGRPOConfig,
    out_dir: str | Path,
    stop_after: int | None = None,
    evaluate: bool = True,
    eval_interval: int = 0,
) -> list[dict[str, Any]]:
    """Run (or resume, from ``out_dir``'s state file) a Flow-GRPO run; append each iteration's metrics to
    ``out_dir/metrics.jsonl`` and save the state after each. ``stop_after``: stop after that many iterations
    in all (a planned interruption). With ``evaluate`` the held-out check runs before the first and after the
    last iteration, and every ``eval_interval`` iterations (records with ``"eval"``).

    Returns:
        the records written by this call.
    """
    out = Path(out_dir)
    run = FlowGRPORun(config)
    state = out / STATE_FILE
    if state.is_file():
        run.load(state)
        logger.info("resumed Flow-GRPO from %s at iteration %d", state, run.iteration_done)
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    records: list[dict[str, Any]] = []
    start: dict[str, Any] | None = None
    if (out / "metrics.jsonl").is_file():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            if line.strip() and json.loads(line).get("eval") == "start":
                start = json.loads(line)

    def write(record: dict[str, Any]) -> None:
        nonlocal start
        if record.get("eval") == "start":
            start = record
        elif "eval" in record and start is not None:
            record.update(paired_gains(start, record))
        records.append(record)
        with (out / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    if evaluate and run.iteration_done == 0:
        write({"eval": "start", "iteration": 0, **run.evaluate()})
    last = config.iterations if stop_after is None else min(stop_after, config.iterations)
    while run.iteration_done < last:
        record = run.iteration()
        logger.info("iteration %d: %s", record["iteration"], ", ".join(f"{k} {v:.4g}" for k, v in record.items()))
        run.save(out)
        write(record)
        done = run.iteration_done
        if evaluate and eval_interval and done % eval_interval == 0 and done < config.iterations:
            write({"eval": "interval", "iteration": done, **run.evaluate()})
    if evaluate and run.iteration_done == config.iterations:
        write({"eval": "end", "iteration": run.iteration_done, **run.evaluate()})
    if config.export_dir and run.iteration_done == config.iterations:
        logger.info("wrote the trained transformer into %s", run.export(config.export_dir))
    return records
