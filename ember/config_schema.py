"""The job configuration's schema: one dataclass per section (`model.*`, `data.*`, `lora.*`, ...) with its keys,
types and defaults, and JobConfig holding them. OmegaConf builds structured configs from these; ember.config
loads recipes and overrides into them and validates across fields (and re-exports every class here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    # family: llama2 | llama3 | llama3.1 | llama3.2 | mixtral | gpt | glam | mistral | phi3 | gemma2 | gemma3 | qwen2 |
    # qwen3 | qwen3_moe | deepseek_v3 | deepseek_v2 | llama4
    family: str = "llama3"
    flavor: str = "debug"  # a key of the family's FLAVORS, e.g. 8B, 70B, 405B, debug
    # Optional fields that override the flavor's hyper-parameters (None keeps the flavor's value).
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None  # each attention head's width (llama, mixtral); default dim // n_heads
    vocab_size: Optional[int] = None
    multiple_of: Optional[int] = None
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    max_seq_len: Optional[int] = None
    ffn_hidden_dim: Optional[int] = None  # the FFN hidden size (MoE: each expert's); Llama derives it unless set
    n_experts: Optional[int] = None
    top_k: Optional[int] = None
    moe_every: Optional[int] = None  # GLaM: layer i has experts when i % moe_every == 0 (2: every other layer)
    # Qwen3-MoE, Llama 4: each expert's SwiGLU hidden size (ffn_hidden_dim: dense layers')
    moe_hidden_dim: Optional[int] = None
    sparse_step: Optional[int] = None  # Qwen3-MoE, Llama 4: layer i has experts when (i + 1) % sparse_step == 0
    norm_topk_prob: Optional[bool] = None  # Qwen3-MoE: renormalise the top-k routing weights to sum to 1
    qkv_bias: Optional[bool] = None  # Qwen: biases on the q/k/v projections (Qwen2's)
    qk_norm: Optional[bool] = None  # Qwen3: RMSNorm over each head's width on q and k; Llama 4: weightless, RoPE layers
    # Llama 4's iRoPE: layer i has no RoPE when (i + 1) % nope_every == 0; the RoPE layers attend within chunks of
    # attention_chunk positions; the NoPE layers scale q by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1
    # (temperature_tuning)
    # DeepSeek: Multi-head Latent Attention's widths (q_lora_rank: the q latent; kv_lora_rank: the cached latent;
    # qk_nope_head_dim + qk_rope_head_dim: each head's q/k; v_head_dim), the dense layers before the MoE ones, the
    # shared experts, and group-limited routing (n_groups groups, the topk_groups best chosen from; route_scale)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    n_dense_layers: Optional[int] = None
    n_shared_experts: Optional[int] = None
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    route_scale: Optional[float] = None
    nope_every: Optional[int] = None
    attention_chunk: Optional[int] = None
    temperature_tuning: Optional[bool] = None
    floor_scale: Optional[int] = None
    attn_scale: Optional[float] = None
    # Sliding-window attention: each query sees the last sliding_window positions (Mistral, Phi-3; Qwen from layer
    # max_window_layers on)
    sliding_window: Optional[int] = None
    max_window_layers: Optional[int] = None
    # MoE auxiliary losses, added to the language-model loss: load balancing (Switch/Mixtral) and the
    # router z-loss (ST-MoE); 0 turns one off. Both are logged.
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's per-expert score bias moves by
    # this much toward balance (the paper's gamma); 0 freezes the biases. Only routers with a score bias use it.
    bias_update_rate: float = 0.001
    # Activation checkpointing (rematerialisation), applied from outside the model (parallel/ac.py):
    # none | full (every block) | selective (every remat_every-th block) | op (save matmul outputs,
    # recompute the rest) | offload (keep activations in host memory)
    remat: str = "none"
    remat_every: int = 2
    # device=tpu|xla: the blocks as one jax.lax.scan over stacked layer weights, so XLA compiles one block
    # whatever the depth (ember/xla/step.py); the torch.distributed path refuses it
    scan_layers: bool = False
    # Weights to start from instead of the random init (continued pretraining, fine-tuning): an ember
    # checkpoint (checkpoints/step-N or a run directory) or a Hugging Face directory, resharded onto
    # whatever mesh this run uses.
    init_from: Optional[str] = None


@dataclass
class MeshConfig:
    """Parallel degrees along each axis; ici_mesh within a node, dcn_mesh across nodes. The DeviceMesh
    has, per axis, dcn x ici devices with the dcn factor outermost. -1 on one axis: whatever is left."""

    data: int = 1  # replicas (DDP-style; with fsdp > 1 this is HSDP's replicate axis)
    fsdp: int = 1  # FSDP2 parameter/gradient/optimizer sharding
    tensor: int = 1  # tensor parallel + sequence parallel
    pipeline: int = 1  # pipeline stages
    context: int = 1  # the sequence split across ranks
    expert: int = 1  # expert parallel (mixture-of-experts models only)


@dataclass
class ParallelConfig:
    """How the techniques of ici_mesh/dcn_mesh behave (ember/parallel/)."""

    reshard_after_forward: bool = True  # FSDP: free gathered parameters after forward (ZeRO-3) or keep (ZeRO-2)
    cpu_offload: bool = False  # FSDP: parameters, gradients and optimizer state in host memory
    mixed_precision: bool = True  # FSDP: bf16 parameters with fp32 reductions when precision is bf16
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_microbatches: int = -1  # pipeline micro-batches per micro_batch_size; -1: one sequence each
    pp_stages_per_rank: int = 1  # virtual stages per rank (interleaved_1f1b needs >= 2)
    loss_parallel: bool = True  # with tensor > 1: cross-entropy on vocabulary-sharded logits
    cp_impl: str = "auto"  # context parallel: auto | allgather (K/V all-gather) | ring (torch's, CUDA)
    timeout_s: int = 600  # collective timeout: a rank that stops answering ends the job after this


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # 0 disables clipping (the norm is still logged)
    implementation: str = "auto"  # auto | fused | foreach | for-loop


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | linear | wsd | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # the final lr is lr * min_lr_ratio
    decay_fraction: float = 0.2  # wsd: share of max_steps spent in the final decay


@dataclass
class MixtureSource:
    source: str  # anything data.dataset accepts: embedded, a local path/glob, a prepared dir, a hub name
    weight: float = 1.0  # relative share of samples (normalised over the mixture)
    text_field: Optional[str] = None  # None: data.text_field
    config: Optional[str] = None  # HF dataset config name


@dataclass
class DataConfig:
    # "embedded" (the built-in corpus), "synthetic" (random tokens), a local path, or a HF dataset name
    dataset: str = "embedded"
    tokenizer: Optional[str] = None  # None: byte-level BPE trained on the embedded corpus; else tokenizer.json
    text_field: str = "text"
    config: Optional[str] = None  # HF dataset config name
    split: str = "train"
    val_fraction: float = 0.02
    # 0: batches are made in the training thread; 1: in one background thread, `prefetch` batches ahead.
    # One thread keeps ahead of any step here (ember/data/prefetch.py says why), so more are refused.
    num_workers: int = 1
    prefetch: int = 4
    # A weighted mixture of sources, e.g. [{source: a.jsonl, weight: 0.4}, {source: b/, weight: 0.6}];
    # when set, it replaces data.dataset. Each sample comes from source i with probability w_i / sum(w).
    mixture: list[MixtureSource] = field(default_factory=list)
    # Stream the source through `datasets` (hub or local files) instead of reading it whole: for corpora
    # larger than memory. Documents pass a shuffle buffer of this many; val_split names the held-out
    # split of a streamed hub dataset (e.g. validation).
    streaming: bool = False
    shuffle_buffer: int = 1000
    val_split: Optional[str] = None
    # Packed documents do not attend to each other: positions restart after each EOS and attention is
    # block-causal (flex attention on CUDA, an SDPA mask on CPU).
    document_mask: bool = False
    # SFT data: rows with a prompt (this field) and a response (text_field); the prompt tokens are read
    # but masked out of the loss (label -100).
    prompt_field: Optional[str] = None
    # Chat SFT data: rows whose field of this name (usually "messages") holds [{"role": "system" | "user" |
    # "assistant", "content": ...}]; rendered with chat_template, the loss covers assistant turns only.
    messages_field: Optional[str] = None
    # auto: the tokenizer folder's template (chat_template.jinja or tokenizer_config.json), as transformers
    # renders it; or a built-in for a folder without one: llama3 | chatml (ember/data/chat.py)
    chat_template: str = "auto"
    # true: documents end to end in every sample (no padding; with document_mask they do not attend to each
    # other); false: one document per sample, cut or padded to seq_len, padding out of the loss
    packing: bool = True


@dataclass
class EvalTask:
    name: str  # lambada | boolq | choice (ember/eval/tasks.py)
    data: str  # a local jsonl file, or the task's name for its hub dataset


@dataclass
class EvalConfig:
    """Downstream tasks. In training they run with the validation loss (every eval_interval steps and at the
    end), logged as eval/<task>/<metric>; `ember eval` reads limit and batch_size from this section too (its
    tasks are its arguments). limit: the first N rows of each task; None (the default): every row, so that a
    number is for the rows the user gave, and a periodic in-loop eval of a large file scores all of it each time
    unless eval.limit is set."""

    # e.g. [{name: lambada, data: lambada.jsonl}, {name: boolq, data: boolq.jsonl}]
    tasks: list[EvalTask] = field(default_factory=list)
    limit: Optional[int] = None
    batch_size: int = 16


@dataclass
class EvalOptions(EvalConfig):
    """`ember eval`'s eval.* keys: training's eval section (its tasks are the command's TASK arguments instead)
    and ppl's sliding window, which only the command has."""

    seq_len: Optional[int] = None  # default: the sequence length the run trained at (its config.yaml), else the model's
    stride: Optional[int] = None  # default: half of seq_len
    max_tokens: Optional[int] = None  # tokens ppl scores (default: all)
    split: Optional[str] = None  # val | train | all; default: val for the run's data, all for ppl=DATA


@dataclass
class EvalCommandConfig:
    """What `ember eval`'s key=value arguments set (ember/eval/options.py): its eval section, and ppl's data
    source, training's data section (the run's own, from its config.yaml, under the command's data.* keys)."""

    eval: EvalOptions = field(default_factory=EvalOptions)
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class MetricsConfig:
    console: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    peak_tflops: Optional[float] = None  # per-device peak, for devices missing from ember.hardware.peaks
    # Experiment trackers (ember/metrics/trackers.py; rank 0 only). Unset keys fall back to wandb's/MLflow's own
    # environment variables (WANDB_PROJECT, WANDB_ENTITY, ..., MLFLOW_TRACKING_URI); API keys only ever there.
    wandb: bool = False  # log every metrics.jsonl record and the resolved config to Weights & Biases
    wandb_project: Optional[str] = None  # default: $WANDB_PROJECT, else "ember"
    wandb_entity: Optional[str] = None
    wandb_name: Optional[str] = None  # default: $WANDB_NAME, else the output_dir's name
    wandb_tags: list[str] = field(default_factory=list)
    wandb_group: Optional[str] = None
    mlflow: bool = False  # log params (the config), metrics and config.yaml to MLflow
    mlflow_experiment: Optional[str] = None  # default: $MLFLOW_EXPERIMENT_NAME, else "ember"


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end); also on SIGTERM/SIGUSR1
    keep: int = 3  # keep the newest K checkpoints (0: all)
    keep_every: int = 0  # and keep every step that is a multiple of this for good (milestones; 0: none)
    async_save: bool = False  # write in the background while training goes on (`checkpoint.async` also works)


@dataclass
class LoraConfig:
    """LoRA (Hu et al. 2021) on a frozen base from model.init_from; ember/finetune/lora.py applies it."""

    rank: int = 0  # r of each adapter; 0: off (full fine-tuning)
    alpha: float = 16.0  # the update is alpha / rank * B A (peft's lora_alpha)
    dropout: float = 0.0  # on the adapter's input only (peft's lora_dropout)
    # all (every linear of attention and MLP) | attn | mlp | a module name (wq, feed_forward.w2, q_proj) or a
    # list of them. Any: a string or a list, which OmegaConf's typed fields cannot both take.
    targets: Any = "all"
    train_embeddings: bool = False  # also train the token (and position) embeddings and the output projection
    train_norms: bool = False  # also train every norm's gain (and bias)


@dataclass
class Fp8Config:
    """Float8 training of the blocks' linears with torchao (ember/parallel/fp8.py); precision=fp8 turns it on."""

    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise (one scale per tensor; float8 FSDP all-gather) | rowwise (per row)
    emulate: bool = False  # float8 arithmetic emulated in higher precision: the code path on devices without FP8


@dataclass
class ProfileConfig:
    """torch.profiler traces of chosen steps (ember/metrics/profiling.py) into OUTPUT_DIR/profile/."""

    enabled: bool = False
    step: int = 3  # the first traced step (1-based, as logged); the first steps compile and warm up
    steps: int = 2  # how many steps are traced


@dataclass
class DPOConfig:
    """Preference pairs for task=dpo (ember/finetune/dpo.py): rows {prompt, chosen, rejected} in data.dataset."""

    beta: float = 0.1  # the strength of the pull toward the reference (DPO's beta)
    prompt_field: str = "prompt"  # text, or a list of messages rendered with data.chat_template
    chosen_field: str = "chosen"  # the preferred response: text (or messages ending with the assistant's)
    rejected_field: str = "rejected"


@dataclass
class GRPOConfig:
    """Reinforcement learning from verifiable rewards for task=grpo (ember/finetune/grpo.py): rollouts of the prompts
    in data.dataset sampled from the policy, scored by the rewards, and the clipped-ratio policy loss. Each step
    trains on global_batch_size completions, group_size of each prompt."""

    group_size: int = 8  # completions sampled per prompt; the advantages compare a completion with its group's
    max_new_tokens: int = 256  # a completion's length limit (a prompt may take seq_len - max_new_tokens tokens)
    temperature: float = 1.0  # sampling temperature; the loss's log-probabilities are of the same tempered policy
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = 0  # sample among the k likeliest tokens (0: off)
    stop: list[str] = field(default_factory=list)  # strings that end a completion (besides EOS)
    # the rollout's decode step through torch.compile, its KV cache seq_len long (one compilation for the run):
    # on a GPU, where a small model's decode is bound by kernel launches; one process, no sharded model
    compile_rollout: bool = False
    rewards: list[str] = field(default_factory=lambda: ["math"])  # exact | math | format | module:function
    reward_weights: list[float] = field(default_factory=list)  # one per reward (empty: 1 each)
    format_pattern: str = ""  # the `format` reward's regex, which the whole completion must match
    reward_errors: str = "fail"  # a reward that raises or times out: fail (one line) | zero (scored 0, counted)
    reward_timeout_s: float = 5.0  # per call of a reward on one completion
    # advantages: true or group: (r - group mean) / (group std + eps) (GRPO); batch: the rollout batch's std;
    # false or none: r - group mean (Dr. GRPO)
    scale_rewards: str = "group"
    loss_type: str = "dapo"  # dapo (token mean over the batch) | grpo (per-completion means) | dr_grpo (/ max length)
    clip_low: float = 0.2  # the ratio pi / pi_old is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # DAPO raises it (0.28) so that unlikely tokens can grow
    beta: float = 0.0  # KL(pi || reference) weight; > 0 keeps the starting model (model.init_from) as the reference
    iterations: int = 1  # optimizer steps per batch of rollouts (the rollout-time log-probs are the old policy)
    mask_truncated: bool = False  # completions cut by max_new_tokens take no part in the loss (DAPO)
    prompt_field: str = "prompt"  # a row's prompt: text, or a list of messages rendered with data.chat_template
    gym_size: int = 1000  # rows drawn from a reasoning_gym:NAME generator (seeded by `seed`)


@dataclass
class DiLoCoConfig:
    """fault_tolerance.semi_sync=diloco: each replica group takes sync_steps local steps, then the groups average
    their pseudo-gradients (the weights' change since the last sync) and an outer SGD step applies it."""

    sync_steps: int = 100  # inner optimizer steps between two syncs (torchft's sync_every)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True


@dataclass
class FaultToleranceConfig:
    """In-job fault tolerance with torchft (ember/train/fault_tolerance.py): the job's data-parallel replicas run as
    `replica_groups` separate torchrun jobs joined by torchft's lighthouse; a dead group is dropped from the step's
    quorum and, restarted, heals from a live peer. Each process's group comes from $EMBER_REPLICA_GROUP and the
    lighthouse from $TORCHFT_LIGHTHOUSE (what `ember launch local --replica-groups R` sets)."""

    enable: bool = False
    replica_groups: int = 1  # the global batch is split over them; a step with fewer groups has fewer tokens
    min_replica_groups: int = 1  # a step commits only with at least this many groups in its quorum
    timeout_s: float = 60.0  # a collective, commit or healing transfer that takes longer drops the peer from the step
    quorum_timeout_s: float = 120.0  # how long a quorum waits for the groups to join
    semi_sync: str = "none"  # none: gradients averaged over the groups every step | diloco (diloco.*)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)


@dataclass
class JobConfig:
    seed: int = 0
    # lm: next-token loss (pretraining, SFT); dpo: preference pairs (dpo.* keys), the reference being the starting
    # model (with LoRA: the base with adapters off); grpo: reinforcement learning from verifiable rewards (grpo.*)
    task: str = "lm"
    max_steps: int = 200
    logging_steps: int = 10
    global_batch_size: int = 16
    micro_batch_size: int = 16  # per device
    seq_len: int = 256
    output_dir: str = "outputs/debug"
    compile: bool = False
    # auto (bf16 with bf16 matmuls: CUDA, AVX512-BF16/AMX CPUs; else fp32) | fp32 | bf16 | fp8 (bf16 + fp8.enabled)
    precision: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | tpu | xla (tpu, or any jax backend: ember/xla/, the .[tpu] extra)
    resume: str = "auto"  # auto (the newest complete checkpoint in output_dir, if any) | none | a checkpoint path
    # Keys of what the run is (model.*, data.*, seed, task, seq_len, global_batch_size, lora.*, dpo.*, optim.name;
    # ember/checkpoint/run_history.py) that this resume may change, e.g. [data.dataset]; a section name covers its keys.
    # Unlisted, such a change is refused on resume.
    resume_allow_changes: list[str] = field(default_factory=list)
    max_skipped_steps: int = 5  # non-finite loss or grad norm: skip the step; stop after this many in a row
    # warn when a step's loss exceeds this times the running mean (0: off; not for task=grpo, whose policy-gradient
    # loss has no level to spike from)
    loss_spike_factor: float = 3.0
    eval_interval: int = 0  # validation loss every N steps (0: only at the end)
    eval_batches: int = 8  # global batches of validation data per evaluation
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ici_mesh: MeshConfig = field(default_factory=lambda: MeshConfig(fsdp=-1))
    dcn_mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
