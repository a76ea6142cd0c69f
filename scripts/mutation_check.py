"""Mutation check: deliberate one-line bugs, each applied alone, must fail a named CPU test.

Each mutation replaces one exact snippet of a source file (it must occur once: a snippet that no
longer matches the code is an error naming it), runs its test with pytest, and restores the
file whatever happens. Prints one line per mutation: caught or NOT caught.

  python -m scripts.mutation_check [--only=SUBSTRING]
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

from absl import app, flags

ONLY = flags.DEFINE_string("only", "", "Run the mutations whose name contains this.")
REPO = pathlib.Path(__file__).resolve().parent.parent

_CURVES_TEST = ("tests/test_tables_curves.py::"
                "test_cell_curves_are_the_mean_and_range_of_the_runs_that_logged_each_step")
MUTATIONS = [  # (name, file, snippet, replacement, the test that must fail)
  ("LRA kernel init reverted to lecun_normal", "lra_sparse/config.py",
   'config.model.kernel_init = "xavier_uniform"', 'config.model.kernel_init = "lecun_normal"',
   "tests/test_lra_model.py::test_default_kernels_are_xavier_uniform"),
  ("attention biases back on by default", "lra_sparse/config.py",
   "config.model.attention_bias = False", "config.model.attention_bias = True",
   "tests/test_lra_model.py::test_default_projections_have_no_bias"),
  ("CLS starts N(0, 0.02) again", "lra_sparse/config.py",
   "config.model.cls_init_std = 0.0 ", "config.model.cls_init_std = 0.02",
   "tests/test_lra_model.py::test_mlp_biases_start_at_lra_normal_1e6_and_cls_at_zeros"),
  ("MLP biases zeros again", "lra_sparse/models/encoder.py",
   "bias_init=normal_or_zeros(mc.mlp_bias_init_std))", "bias_init=nn.initializers.zeros)",
   "tests/test_lra_model.py::test_mlp_biases_start_at_lra_normal_1e6_and_cls_at_zeros"),
  ("classifier head in the compute dtype", "lra_sparse/models/encoder.py",
   "return jnp.float32 if model_config.float32_head else compute_dtype(model_config)",
   "return compute_dtype(model_config)",
   "tests/test_lra_model.py::test_classifier_head_runs_in_float32_in_a_bf16_model"),
  ("old runs not read back with the earlier model", "lra_sparse/config.py",
   ") + tuple((key, value, None) for key, value in EARLIER_MODEL.items())", ")",
   "tests/test_lra_model.py::test_a_run_recorded_before_the_fields_reads_back_the_earlier_model"),
  ("key mask applied to queries instead (dense, XLA)", "lra_sparse/attention/dense.py",
   "bias_mask = None if mask is None else mask[:, None, None, :]",
   "bias_mask = None if mask is None else mask[:, None, :, None]",
   "tests/test_lra_model.py::test_padded_queries_do_not_change_the_logits"),
  ("train-mode evaluation without dropout", "lra_sparse/train.py",
   "apply = lambda b: model.apply(variables, b, deterministic=not train_mode,",
   "apply = lambda b: model.apply(variables, b, deterministic=True,",
   "tests/test_lra_model.py::test_evaluations_record_the_predicted_class_histogram_and_train_mode"),
  ("predicted-class histogram unweighted (padding rows counted)", "lra_sparse/train.py",
   "predicted = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1]) * weights[:, None]",
   "predicted = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1])",
   "tests/test_lra_model.py::test_predicted_class_histogram_counts_real_examples_only"),
  ("cosine schedule one warmup step late", "lra_sparse/train.py",
   "warmup = min(int(oc.warmup_steps), max(num_train_steps - 1, 0))",
   "warmup = min(int(oc.warmup_steps) + 1, max(num_train_steps - 1, 0))",
   "tests/test_training_behaviour.py::test_cosine_schedule_is_linear_warmup_then_half_cosine_to_zero"),
  ("gradient clipping dropped", "lra_sparse/train.py",
   "  if oc.grad_clip_norm > 0:\n    return optax.chain", "  if False:\n    return optax.chain",
   "tests/test_training_behaviour.py::test_gradient_clipping_rescales_a_large_gradient_to_the_norm"),
  ("pad_multiple ignored", "lra_sparse/models/encoder.py",
   "multiple = max(1, int(model_config.pad_multiple))", "multiple = 1",
   "tests/test_training_behaviour.py::test_pad_multiple_pads_the_sequence_without_changing_the_logits"),
  ("init_from copies nothing", "lra_sparse/checkpointing.py",
   "      merged[path] = jnp.asarray(old[path], value.dtype)", "      merged[path] = value",
   "tests/test_training_behaviour.py::test_fine_tuning_a_dense_run_into_another_kind"),
  ("DSA predictor-only L_MSE still trains the query projection", "lra_sparse/attention/dsa.py",
   "else (jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)))",
   "else (q, jax.lax.stop_gradient(k)))",
   "tests/test_attention_kinds.py::"
   "test_dsa_mse_gradient_predictor_leaves_q_and_k_to_the_task_loss"),
  ("DSA Eq. 6 weight pick ignores the validation noise", "experiments/specs/dsa_listops.py",
   "close = [w for w in WEIGHTS if accuracy[w] >= best - VAL_NOISE]",
   "close = [w for w in WEIGHTS if accuracy[w] >= best]",
   "tests/test_sweep_tables.py::"
   "test_dsa_weight_pick_accuracy_first_then_hit_rate_within_the_noise"),
  ("DSA predictor input not quantised", "lra_sparse/attention/dsa.py",
   "x = dsa_reference.fake_quantize(inputs.astype(jnp.float32), config.quant_bits, real_tokens)",
   "x = inputs.astype(jnp.float32)",
   "tests/test_attention_kinds.py::test_dsa_quantised_module_follows_the_numpy_chain"),
  ("DSA quantisation scale taken over padding too", "lra_sparse/attention/dsa.py",
   "x = dsa_reference.fake_quantize(inputs.astype(jnp.float32), config.quant_bits, real_tokens)",
   "x = dsa_reference.fake_quantize(inputs.astype(jnp.float32), config.quant_bits)",
   "tests/test_attention_kinds.py::test_dsa_quantised_module_follows_the_numpy_chain"),
  ("DSA key predictor weight not quantised", "lra_sparse/attention/dsa.py",
   "w_key = dsa_reference.fake_quantize(w_key, config.quant_bits)", "w_key = w_key",
   "tests/test_attention_kinds.py::test_dsa_quantised_module_follows_the_numpy_chain"),
]
MUTATIONS += [
  ("DSA codes rank the lowest scores first", "lra_sparse/kernels/dsa/reference.py",
   "return jnp.where(valid, (s - lo) >> shift, -1)", "return jnp.where(valid, (hi - s) >> shift, -1)",
   "tests/test_attention_kinds.py::test_dsa_selection_is_float_topk_where_the_margin_exceeds_its_resolution"),
  ("DSA keep count rounded down", "lra_sparse/kernels/dsa/reference.py",
   "return jnp.maximum(jnp.ceil((1.0 - sparsity) * n_real - 1e-6), 1.0).astype(jnp.int32)",
   "return jnp.maximum(jnp.floor((1.0 - sparsity) * n_real - 1e-6), 1.0).astype(jnp.int32)",
   "tests/test_attention_kinds.py::test_dsa_selection_is_float_topk_where_the_margin_exceeds_its_resolution"),
  ("attention dropout without the 1 / (1 - rate) rescale", "lra_sparse/ops/dropout.py",
   "return jnp.where(draws >= t, np.float32(keep_scale(t)), np.float32(0.0))",
   "return jnp.where(draws >= t, np.float32(1.0), np.float32(0.0))",
   "tests/test_attention_kinds.py::test_attention_dropout_drops_at_its_rate_and_rescales_by_one_over_keep"),
  ("dense XLA dropout draws another seed than the kernels", "lra_sparse/ops/softmax.py",
   "mult = dropout.key_multiplier(dropout.seed_words(rng), 1,",
   "mult = dropout.key_multiplier(dropout.seed_words(jax.random.fold_in(rng, 1)), 1,",
   "tests/test_attention_kinds.py::test_dense_dropout_on_xla_is_the_kernels_mask_in_float64"),
  ("Philox dropout threshold at half the rate (DFSS, DSA)", "lra_sparse/ops/dropout.py",
   "t = int(round(rate * _HALF))", "t = int(round(rate * _HALF / 2))",
   "tests/test_attention_kinds.py::test_attention_dropout_drops_at_its_rate_and_rescales_by_one_over_keep"),
  ("dropout halves in the wrong order (pure JAX)", "lra_sparse/ops/dropout.py",
   "halves = jnp.stack([words & 0xFFFF, words >> HALF_BITS], axis=-1)",
   "halves = jnp.stack([words >> HALF_BITS, words & 0xFFFF], axis=-1)",
   "tests/test_kernels.py::test_dropout_multiplier_matches_numpy_rule"),
  ("Mosaic dropout reads the wrong word of a group's call", "lra_sparse/kernels/dfss/mosaic.py",
   "base = None if m == dropout.KEY_GROUP else (first & 7) >> 1",
   "base = None if m == dropout.KEY_GROUP else (first & 3) >> 1",
   "tests/test_kernels.py::test_mosaic_dropout_draws_match_numpy_rule"),
  ("Triton DFSS dropout counter per 4 keys", "lra_sparse/kernels/shared/philox.py",
   "o = tl.philox_impl((first // 8).to(tl.uint32), c1, c2, uzero, k0, k1, ROUNDS)",
   "o = tl.philox_impl((first // 4).to(tl.uint32), c1, c2, uzero, k0, k1, ROUNDS)",
   "tests/test_kernels.py::test_kernel_source_on_the_cpu_matches_reference"),
  ("dense 'auto' trains dropout on XLA on a Hopper", "lra_sparse/attention/dense.py",
   'if implementation == "auto" and _half(q) and _mosaic_runs(q, k, v):',
   "if False:",
   "tests/test_attention_kinds.py::test_dense_auto_routes_dropout_and_holes_to_the_mosaic_kernels"),
  ("Gram kernels' dK dropped", "lra_sparse/kernels/dsa/gram.py",
   "return dq, dk, dxp, dw_q, dw_k, None, None",
   "return dq, jnp.zeros_like(dk), dxp, dw_q, dw_k, None, None",
   "tests/test_dsa_gram.py::test_gram_kernel_source_on_the_cpu_matches_float64"),
  ("Gram kernels' key-predictor weight gradient dropped", "lra_sparse/kernels/dsa/gram.py",
   "return dq, dk, dxp, dw_q, dw_k, None, None",
   "return dq, dk, dxp, dw_q, 0.5 * dw_k, None, None",
   "tests/test_dsa_gram.py::test_gram_kernel_source_on_the_cpu_matches_float64"),
  ("denoising loss counts unselected positions", "lra_sparse/objectives.py",
   "selected[key] & (weights[:, None] > 0))",
   "(batch[key] >= 0) & (weights[:, None] > 0))",
   "tests/test_self_pretraining.py::test_denoising_loss_counts_selected_positions_only"),
  ("corruption selects padding", "lra_sparse/objectives.py",
   "selected = (tokens != pad_id) & (jax.random.uniform(k_select, tokens.shape) < mask_rate)",
   "selected = jax.random.uniform(k_select, tokens.shape) < mask_rate",
   "tests/test_self_pretraining.py::test_corruption_on_a_hand_worked_batch"),
  ("rotary as a reflection, not a rotation", "lra_sparse/models/encoder.py",
   "x1 * sin + x2 * cos], -1)", "x1 * sin - x2 * cos], -1)",
   "tests/test_self_pretraining.py::test_rotary_positions_are_relative"),
  ("fine-tune drops the mask token's embedding row", "lra_sparse/models/__init__.py",
   'embed_rows = vocab_size + (1 if config.model.get("mask_token", False) else 0)',
   "embed_rows = vocab_size",
   "tests/test_self_pretraining.py::test_fine_tune_loads_every_encoder_parameter_and_no_lm_head"),
  ("SPT's from-scratch row not the fine-tune's config", "experiments/specs/self_pretraining.py",
   "overrides=finetune, seeds=seeds, step_cost=STEP_COST[label]))",
   'overrides={**finetune, "model.mask_token": False}, seeds=seeds,\n'
   '                          step_cost=STEP_COST[label]))',
   "tests/test_self_pretraining.py::test_self_pretraining_spec_runs_both_stages_end_to_end"),
  ("SPT recipe rows that do not name the kind", "experiments/specs/self_pretraining.py",
   'RECIPE_FIELDS = {"attention.kind": "dense", "model.pos_emb": "sinusoidal",',
   'RECIPE_FIELDS = {"model.pos_emb": "sinusoidal",',
   "tests/test_self_pretraining.py::test_recipe_presets_pretrain_fine_tune_and_train_from_scratch"),
  ("SPT recipe tables blind to the conv skip on V", "experiments/specs/self_pretraining.py",
   'return {"model.value_conv_kernel": 0, **fields}', "return dict(fields)",
   "tests/test_self_pretraining.py::test_recipe_presets_pretrain_fine_tune_and_train_from_scratch"),
  ("rotary_long's softmax kinds without rotary", "experiments/specs/self_pretraining.py",
   '"rotary_long": LongPreset(ROTARY, ", rotary positions",',
   '"rotary_long": LongPreset({}, ", rotary positions",',
   "tests/test_self_pretraining.py::test_long_presets_are_the_measured_recipe"),
  ("conv_long's softmax kinds without the conv skip", "experiments/specs/self_pretraining.py",
   '_CONV_FIELDS = ({**ROTARY, **CONV_SKIP}, ", rotary positions, conv skip of 35 on V",',
   '_CONV_FIELDS = (ROTARY, ", rotary positions, conv skip of 35 on V",',
   "tests/test_self_pretraining.py::test_long_presets_are_the_measured_recipe"),
  ("conv_pathfinder with ListOps' warmup rule", "experiments/specs/self_pretraining.py",
   '*_CONV_FIELDS, task="pathfinder32", listops_warmup=False,',
   '*_CONV_FIELDS, task="pathfinder32",',
   "tests/test_self_pretraining.py::test_long_presets_are_the_measured_recipe"),
  ("nystrom_pathx runs every kind", "experiments/specs/self_pretraining.py",
   'listops_warmup=False, kinds=("nystrom",), seeds=(0,),',
   'listops_warmup=False, seeds=(0,),',
   "tests/test_self_pretraining.py::test_pathx_preset_is_nystromformer_at_whole_epochs"),
  ("long-preset tables blind to the conv skip on V", "experiments/specs/self_pretraining.py",
   "match = _with_conv if long else dict", "match = dict",
   "tests/test_self_pretraining.py::test_long_presets_are_the_measured_recipe"),
  ("a row's delta against another row with its sign flipped", "lra_sparse/tables/cells.py",
   "cell.versus.append((name, cell.mean - theirs))",
   "cell.versus.append((name, theirs - cell.mean))",
   "tests/test_sweep_tables.py::test_cells_show_their_delta_against_another_row"),
  ("SPT tables without the sparse kinds' delta against dense", "experiments/specs/self_pretraining.py",
   'versus["vs dense + SPT"] = f"{dense_row} + SPT"', "pass",
   "tests/test_self_pretraining.py::test_main_tables_hold_each_run_once"),
  ("a new run on the first free slot, busy GPU or not", "lra_sparse/sweep/local.py",
   "return min(range(len(free_slots)), key=lambda i: (slot_load(i), i))", "return 0",
   "tests/test_sweep_tables.py::test_a_new_run_goes_to_the_least_busy_gpu"),
  ("parallel slots launch in the spec's order", "lra_sparse/sweep/local.py",
   "queue.sort(key=lambda run: -work[run.name])", "pass",
   "tests/test_sweep_tables.py::test_parallel_slots_launch_the_longest_chain_first"),
  ("step_cost ignored by the run's cost", "lra_sparse/sweep/spec.py",
   "cost=step_cost * (steps", "cost=1 * (steps",
   "tests/test_sweep_tables.py::test_parallel_slots_launch_the_longest_chain_first"),
  ("DSA-90 no slower than the other kinds in the SPT spec", "experiments/specs/self_pretraining.py",
   '"dsa90": 4,', '"dsa90": 1,',
   "tests/test_self_pretraining.py::test_slow_kinds_launch_first_on_parallel_slots"),
  ("curves keep the first record of a re-logged step", "lra_sparse/tables/curves.py",
   "      curve[int(step)] = float(value)", "      curve.setdefault(int(step), float(value))",
   _CURVES_TEST),
  ("curves leave out cut runs", "lra_sparse/tables/curves.py",
   "    if not rows or not columns:",
   "    if not rows or not columns or run.status != \"finished\":",
   _CURVES_TEST),
  ("the conv skip on V sees padded keys", "lra_sparse/attention/nystrom.py",
   "return depthwise_length_conv(jnp.where(real, v, 0), kernel, residual=out)",
   "return depthwise_length_conv(v, kernel, residual=out)",
   "tests/test_self_pretraining.py::test_value_conv_skip_is_a_depthwise_conv_of_v_added_to_attention"),
  ("every kind builds dense attention", "lra_sparse/attention/registry.py",
   "return _REGISTRY[kind_config.KIND].build(kind_config, dims)",
   "return _REGISTRY[\"dense\"].build(_REGISTRY[\"dense\"].config_class(), dims)",
   "tests/test_training_behaviour.py::test_each_kind_builds_its_own_attention"),
  ("dense float32 'auto' on XLA, not the Triton kernels", "lra_sparse/attention/dense.py",
   'if implementation == "triton" or (implementation == "auto" and not _half(q)\n'
   '                                    and _triton_runs(q, k, v)):',
   'if implementation == "triton":',
   "tests/test_attention_kinds.py::test_dense_auto_routes_dropout_and_holes_to_the_mosaic_kernels"),
  ("Triton 1:1 dropout draws of the next eight keys", "lra_sparse/kernels/shared/philox.py",
   "return (key_draws(k0, k1, bh, rows, start, G, TRANSPOSE),)",
   "return (key_draws(k0, k1, bh, rows, start + 8, G, TRANSPOSE),)",
   "tests/test_kernels.py::test_kernel_source_on_the_cpu_matches_reference"),
  ("a zeroed output row in the Triton forward", "lra_sparse/kernels/dfss/triton_kernels.py",
   "out = acc / l_safe[:, None]",
   "out = tl.where((offs_m[:, None] == 37) & (bh == 1), 0.0, acc / l_safe[:, None])",
   "tests/test_kernels.py::test_kernel_source_on_the_cpu_matches_reference"),
  ("a carried run packs its oldest checkpoint", "lra_sparse/sweep/carry.py",
   "  return max(steps) if steps else None\n\n\ndef _run_dirs",
   "  return min(steps) if steps else None\n\n\ndef _run_dirs",
   "tests/test_reliability.py::test_a_carried_run_resumes_bit_identically"),
  ("block DSA pools the padding into its block means", "lra_sparse/kernels/dsa/reference.py",
   "  real = jnp.ones((b, length), bool) if mask is None else mask.astype(bool)\n  real = jnp.pad(",
   "  real = jnp.ones((b, length), bool)\n  real = jnp.pad(",
   "tests/test_attention_kinds.py::test_dsa_block_granularity_follows_the_numpy_chain"),
  ("block DSA attends to padded keys of a kept block", "lra_sparse/kernels/dsa/reference.py",
   "  return keep if mask is None else keep & mask.astype(bool)[:, None, None, :]",
   "  return keep",
   "tests/test_attention_kinds.py::test_dsa_block_granularity_follows_the_numpy_chain"),
  ("block DSA bits keep padded keys", "lra_sparse/kernels/dsa/reference.py",
   "  if mask is not None:\n    keys = keys & mask.astype(bool)[:, None, None, :]\n",
   "",
   "tests/test_dsa_kernels.py::test_block_bits_are_the_expanded_block_keep"),
  ("block DSA tile lists name the tiles without a kept entry",
   "lra_sparse/kernels/dsa/reference.py",
   "jnp.argsort(jnp.logical_not(hits), axis=-1, stable=True)",
   "jnp.argsort(hits, axis=-1, stable=True)",
   "tests/test_dsa_kernels.py::test_tile_lists_are_the_tiles_with_a_kept_entry"),
  ("block DSA dK/dV kernels drop a listed query tile",
   "lra_sparse/kernels/dsa/attention_kernels.py",
   "      if start < rows:\n",
   "      if start + BM < rows:\n",
   "tests/test_dsa_kernels.py::test_kernel_source_on_the_cpu_matches_reference"),
]


def main(argv):
  del argv
  missed = 0
  for name, path, old, new, test in MUTATIONS:
    if ONLY.value and ONLY.value not in name:
      continue
    source = REPO / path
    text = source.read_text()
    if text.count(old) != 1:
      raise app.UsageError(f"mutation {name!r}: its snippet occurs {text.count(old)} times in "
                           f"{path} (the code changed: update the mutation)")
    source.write_text(text.replace(old, new))
    try:
      result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", test], cwd=REPO, capture_output=True,
                              text=True, timeout=900, check=False)
    finally:
      source.write_text(text)
    caught = result.returncode != 0
    missed += not caught
    print(f"{'caught    ' if caught else 'NOT caught'} | {name} | {path} | {test}", flush=True)
  sys.exit(1 if missed else 0)


if __name__ == "__main__":
  app.run(main)
