"""The surface of ``params.yaml`` grows on purpose, as torchtitan's ``test_no_new_cli_options.py`` holds its flags: its
keys are listed here, so a key added, dropped or renamed — in ``params.yaml``, in a section of
``src/distillery/pipeline/params/schema.py`` or with a recipe's knobs (``stages/recipes/``) — is a change this file
shows in review. A new method needs no new key (its knobs take their defaults until a user sets one); a knob shipped
in ``params.yaml`` is a line here.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from distillery.pipeline.params.reader import Params

ROOT = Path(__file__).resolve().parents[1]

KEYS = """
seed
gpus.nproc_per_node gpus.nnodes gpus.launcher gpus.rdzv_endpoint gpus.replicate_size gpus.sp_size gpus.tp_size
clips.num_train clips.num_validation clips.num_frames clips.size clips.fps
base.path
latents.data latents.rows_per_shard latents.max_bad_fraction latents.num_frames latents.height latents.width
latents.fps latents.device latents.negative_prompt
prompts.path prompts.rows_per_shard prompts.num_frames prompts.height prompts.width prompts.device
prompts.max_file_bytes prompts.max_prompt_chars
teacher.method teacher.source teacher.path teacher.steps teacher.batch_size teacher.learning_rate
teacher.lr_scheduler teacher.warmup_steps teacher.weight_decay teacher.ema_decay teacher.ema_start_step
teacher.save_every teacher.activation_checkpointing teacher.activation_checkpointing_fraction
teacher.lora_rank teacher.lora_alpha teacher.sp_size teacher.tp_size teacher.attention teacher.sparsity teacher.sparse_tile
pretrain.steps pretrain.batch_size pretrain.learning_rate pretrain.lr_scheduler pretrain.warmup_steps
pretrain.weight_decay pretrain.ema_decay pretrain.ema_start_step pretrain.chunk_size pretrain.student_init
pretrain.method pretrain.t_list pretrain.teacher_steps pretrain.guidance_scale pretrain.seeds_per_prompt
pretrain.trajectory_batch_size pretrain.trajectory_rows_per_shard pretrain.data pretrain.source pretrain.path
pretrain.save_every pretrain.activation_checkpointing pretrain.activation_checkpointing_fraction
pretrain.lora_rank pretrain.lora_alpha pretrain.sp_size pretrain.tp_size pretrain.attention pretrain.sparsity pretrain.sparse_tile
distill.method distill.steps distill.batch_size distill.learning_rate distill.lr_scheduler
distill.warmup_steps distill.weight_decay distill.ema_decay distill.ema_start_step
distill.critic_learning_rate distill.critic_init distill.student_steps distill.generator_update_interval
distill.guidance_scale distill.guidance_scale_2 distill.context_noise distill.same_step_across_chunks distill.student_shift
distill.data distill.save_every distill.gan_weight distill.collapse_every distill.stop_on_collapse
distill.activation_checkpointing distill.activation_checkpointing_fraction
distill.lora_rank distill.lora_alpha distill.sp_size distill.tp_size distill.attention distill.sparsity distill.sparse_tile
pdd.student_init pdd.steps pdd.batch_size pdd.learning_rate pdd.lr_scheduler pdd.warmup_steps
pdd.weight_decay pdd.ema_decay pdd.ema_start_step pdd.pdd_steps pdd.block_size_min pdd.block_size_max
pdd.rollout pdd.integrator pdd.guidance_scale pdd.sampling_steps pdd.method pdd.dm_weight
pdd.critic_learning_rate pdd.data pdd.save_every pdd.activation_checkpointing
pdd.activation_checkpointing_fraction pdd.lora_rank pdd.lora_alpha pdd.sp_size pdd.tp_size pdd.attention pdd.sparsity pdd.sparse_tile
posttrain.enabled posttrain.method posttrain.student posttrain.steps posttrain.batch_size
posttrain.learning_rate posttrain.lr_scheduler posttrain.warmup_steps posttrain.weight_decay posttrain.ema_decay
posttrain.ema_start_step posttrain.samples_per_prompt posttrain.minibatch_size posttrain.inner_epochs
posttrain.rollout_steps posttrain.timestep_fraction posttrain.beta posttrain.kl_beta posttrain.reward_adherence
posttrain.reward_clip posttrain.reward_preference posttrain.clip_model posttrain.preference_model
posttrain.preference_label posttrain.data posttrain.save_every posttrain.activation_checkpointing
posttrain.activation_checkpointing_fraction posttrain.lora_rank posttrain.lora_alpha posttrain.sp_size posttrain.tp_size
posttrain.attention posttrain.sparsity posttrain.sparse_tile
validate.num_prompts validate.num_seeds validate.teacher_steps validate.pretrain_steps
validate.guidance_scale validate.pdd_nfe validate.device validate.vae_precision validate.vae_chunk_frames
validate.compile validate.clip_model validate.vbench.dimensions validate.vbench.models.dino validate.vbench.models.clip_b32
validate.vbench.models.clip_l14 validate.vbench.models.aesthetic validate.vbench.models.amt validate.vbench.models.raft
validate.vbench.models.musiq validate.vbench.models.viclip
export.student export.lora
""".split()


def _dotted(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        dotted = f"{prefix}.{key}" if prefix else key
        keys += _dotted(value, dotted) if isinstance(value, dict) else [dotted]
    return keys


def test_params_yaml_holds_exactly_these_keys():
    assert _dotted(yaml.safe_load((ROOT / "params.yaml").read_text())) == KEYS


def test_the_stages_read_exactly_these_keys():
    """What the stages read of the shipped file (the schema's sections with the chosen recipes' knobs, and the knobs
    of the recipes not chosen as written) is the same list: no key the file holds goes unread, none read is absent."""
    assert sorted(_dotted(Params.load(ROOT / "params.yaml").data)) == sorted(KEYS)
