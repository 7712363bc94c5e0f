"""The run config schema: YAML + overrides, typed, with errors that name the key."""

from pathlib import Path

import pytest

from app.config import AppConfig, ConfigError, RewardConfig, RolloutConfig, RunConfig, load, load_app, to_yaml
from app.models.family import get_family

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_tiny_config_loads_with_yaml_values_and_schema_defaults():
    cfg = load(CONFIGS / "tiny_cpu.yaml")
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.group_size == 4 and cfg.rollout.height == 64  # from the YAML
    assert cfg.rollout.sde_type == "sde" and cfg.train.adv_std_mode == "group"  # schema defaults


def test_overrides_are_typed():
    cfg = load(CONFIGS / "tiny_cpu.yaml", ["train.learning_rate=1e-2", "rollout.sde_type=cps"])
    assert cfg.train.learning_rate == pytest.approx(1e-2) and isinstance(cfg.train.learning_rate, float)
    assert cfg.rollout.sde_type == "cps"


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="train.learning_rat"):
        load(CONFIGS / "tiny_cpu.yaml", ["train.learning_rat=1e-3"])


def test_unknown_key_in_yaml_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "tiny_cpu.yaml").read_text() + "\nrollout_extra: 1\n")
    with pytest.raises(ConfigError, match="rollout_extra"):
        load(bad)


def test_wrong_type_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load(CONFIGS / "tiny_cpu.yaml", ["rollout.group_size=many"])


def test_missing_required_values_are_listed():
    with pytest.raises(ConfigError, match="data.prompts.*model.path|model.path.*data.prompts"):
        load(None, [])


def test_gpu_config_needs_its_paths():
    with pytest.raises(ConfigError, match="model.path"):
        load(CONFIGS / "qwen_image_ocr.yaml")
    cfg = load(CONFIGS / "qwen_image_ocr.yaml", ["model.path=/models/Qwen-Image", "data.prompts=/data/ocr.txt"])
    assert cfg.cluster.use_gpu and cfg.rollout.guidance_scale == 4.0


@pytest.mark.parametrize("override,match", [
    ("rollout.height=100", "multiple of 16"),
    ("rollout.num_inference_steps=1", "num_inference_steps"),
    ("rollout.group_size=1", "group_size"),
    ("rollout.sde_type=ddim", "sde_type"),
    ("train.groups_per_step=3", "divisible by cluster.num_workers"),
    ("train.micro_batch_size=3", "micro_batch_size"),
    ("rollout.noise_level=0", "noise_level"),
    ("rollout.engine=vllm",
     "'rollout.engine': Invalid value 'vllm', expected one of \\[vllm_omni, diffusers, bagel\\]"),
    ("rollout.engine=bagel", "rollout.engine=bagel cannot run model.family=qwen_image"),
    ("reward.ocr_detect_min_side=16", "reward.ocr_detect_min_side=16 must be >= 32"),
    ("rollout.sde_window.size=9", "rollout.sde_window.size=9 must be in \\[0, rollout.num_inference_steps"),
    ("rollout.sde_window.placement=cyclic", "rollout.sde_window.placement"),
    ("rollout.sde_window.range=[3,9]", "rollout.sde_window.range=\\[3, 9\\] must be \\[lo, hi\\]"),
    ("train.checkpoints_to_keep=0", "train.checkpoints_to_keep=0 must be >= 1, or null"),
])
def test_cross_field_checks_say_what_to_change(override, match):
    overrides = [override, "cluster.num_workers=2"] if "divisible" in match else [override]
    with pytest.raises(ConfigError, match=match):
        load(CONFIGS / "tiny_cpu.yaml", overrides)


def test_merging_the_adapter_needs_an_engine_that_folds_it_and_the_trainers_old_log_probs():
    with pytest.raises(ConfigError, match="rollout.merge_lora: vllm-omni's bagel pipeline applies its adapter with"):
        load(CONFIGS / "tiny_bagel_cpu.yaml", ["rollout.engine=vllm_omni", "rollout.merge_lora=true",
                                               "train.old_logprob=trainer"])
    with pytest.raises(ConfigError, match="merged_base_on=device: the vllm_omni engine keeps"):
        load(CONFIGS / "tiny_cpu.yaml", ["rollout.merge_lora=true", "train.old_logprob=trainer",
                                         "rollout.merged_base_on=device"])
    vllm = load(CONFIGS / "tiny_cpu.yaml", ["rollout.merge_lora=true", "train.old_logprob=trainer"])
    assert vllm.rollout.engine == "vllm_omni" and vllm.rollout.merge_lora
    with pytest.raises(ConfigError, match="set train.old_logprob=trainer"):
        load(CONFIGS / "tiny_cpu.yaml", ["rollout.merge_lora=true", "rollout.engine=diffusers",
                                         "train.old_logprob=rollout"])
    with pytest.raises(ConfigError, match="merged_base_on.*expected one of \\[device, host, auto\\]"):
        load(CONFIGS / "tiny_cpu.yaml", ["rollout.merged_base_on=gpu"])
    config = load(CONFIGS / "tiny_cpu.yaml", ["rollout.merge_lora=true", "rollout.engine=diffusers",
                                              "train.old_logprob=trainer", "rollout.merged_base_on=host"])
    assert config.rollout.merge_lora and config.rollout.merged_base_on == "host"


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        load(CONFIGS / "tiny_cpu.yaml", ["train.learning_rate"])


def test_round_trip_through_yaml(tmp_path):
    cfg = load(CONFIGS / "tiny_cpu.yaml", ["train.seed=7"])
    saved = tmp_path / "resolved.yaml"
    saved.write_text(to_yaml(cfg))
    assert load(saved) == cfg


def test_reward_weights_in_a_yaml_replace_the_default_instead_of_merging(tmp_path):
    """A config naming only JPEG compressibility trains on exactly that (OmegaConf alone would add the schema's
    default `ocr: 1.0`)."""
    config = tmp_path / "jpeg_only.yaml"
    config.write_text("model: {path: m}\ndata: {prompts: ocr_tiny}\nreward: {weights: {jpeg_compressibility: 2.0}}\n")
    assert load(config).reward.weights == {"jpeg_compressibility": 2.0}
    assert load(None, ["model.path=m", "data.prompts=p"]).reward.weights == {"ocr": 1.0}  # the default alone


def test_reward_weights_override_replaces_the_mapping_and_a_dotted_one_edits_an_entry():
    assert load(CONFIGS / "tiny_cpu.yaml").reward.weights == {"ocr": 1.0, "jpeg_compressibility": 1.0}
    only = load(CONFIGS / "tiny_cpu.yaml", ["reward.weights={jpeg_compressibility: 1.0}"])
    assert only.reward.weights == {"jpeg_compressibility": 1.0}
    edited = load(CONFIGS / "tiny_cpu.yaml", ["reward.weights.ocr=0.5"])
    assert edited.reward.weights == {"ocr": 0.5, "jpeg_compressibility": 1.0}


@pytest.mark.parametrize("override", ["reward.weights={ocrr: 1.0}", "reward.weights.jpeg=1.0"])
def test_unknown_reward_names_are_rejected_at_load_time(override):
    with pytest.raises(ConfigError, match=r"reward.weights names unknown rewards \['(ocrr|jpeg)'\].*known"):
        load(CONFIGS / "tiny_cpu.yaml", [override])


def test_fault_tolerance_and_console_settings_have_safe_defaults():
    cfg = load(CONFIGS / "tiny_cpu.yaml")
    assert cfg.train.max_failures >= 1 and cfg.rollout.request_retries >= 1 and cfg.logging.verbose is False
    with pytest.raises(ConfigError, match="rollout.request_retries"):
        load(CONFIGS / "tiny_cpu.yaml", ["rollout.request_retries=-1"])


def test_enumerated_choices_are_the_library_s_own(monkeypatch):
    import importlib.util
    import sys

    import app.algo.sde
    import app.config
    from app.algo.sde import SDE_TYPES
    from app.algo.sde_window import PLACEMENTS
    from app.config import CfgRenorm, SdeType, WindowPlacement
    from app.types import CFG_RENORMS

    for enum, choices in [(SdeType, SDE_TYPES), (WindowPlacement, PLACEMENTS), (CfgRenorm, CFG_RENORMS)]:
        assert tuple(enum) == choices and [m.name for m in enum] == list(choices)
    cfg = load(CONFIGS / "tiny_cpu.yaml", ["rollout.sde_type=cps", "rollout.engine=diffusers"])
    assert cfg.rollout.sde_type == "cps" and f"{cfg.rollout.engine}" == "diffusers"
    # OmegaConf matches a setting to a member by name: "global" (once refused: the member was named global_)
    assert load(CONFIGS / "tiny_bagel_cpu.yaml", ["rollout.cfg_renorm=global"]).rollout.cfg_renorm == "global"
    # the enum is built from the tuple: a sampler added to app/algo/sde.py is a choice of the schema, unwritten
    monkeypatch.setattr(app.algo.sde, "SDE_TYPES", (*SDE_TYPES, "ddim"))
    spec = importlib.util.spec_from_file_location("config_with_ddim", app.config.__file__)
    again = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, again)  # dataclasses look their module up while they are built
    spec.loader.exec_module(again)
    assert tuple(again.SdeType) == (*SDE_TYPES, "ddim")


# the rules a rollout section shares with every request (GenerationRequest's, their one home): a bad value of each
SHARED_RULES = [("height", 100), ("width", 8), ("num_inference_steps", 1), ("noise_level", -0.5),
                ("guidance_scale", 0.5), ("image_guidance_scale", 0.5), ("cfg_interval", [0.5, 0.2]),
                ("cfg_renorm_min", 2.0), ("timestep_shift", 0.0)]


@pytest.mark.parametrize("field,value", SHARED_RULES)
def test_a_rollout_setting_and_a_request_field_obey_one_rule(field, value):
    from app.types import GenerationRequest, RequestError

    sampling = dict(height=64, width=64, num_inference_steps=4, noise_level=0.7, sde_type="sde")
    with pytest.raises(RequestError) as refused:
        GenerationRequest("a sign", **sampling | {field: value})
    assert refused.value.field == field
    with pytest.raises(ConfigError) as config_error:
        load(CONFIGS / "tiny_bagel_cpu.yaml", [f"rollout.{field}={value}"])
    message = str(config_error.value)
    assert message.startswith(f"rollout.{field}=") and message.endswith(f": {refused.value.why}"), message


def test_a_section_s_group_is_a_request_s_n():
    """The section's group_size is the request's n: its bound names the section's key (a Serve app has no
    group_size >= 2 rule of its own: the request's n <= 256 is the one it needs)."""
    args = serve_config_args()
    with pytest.raises(ConfigError, match=r"^rollout.group_size=1000: must be an integer in \[1, 256\]"):
        load_app({**args, "rollout": {**args["rollout"], "group_size": 1000}})


# -- the Serve application's config: serve_config.yaml's `args:` are a run config's sections plus `serve`

def serve_config_args() -> dict:
    import yaml

    return yaml.safe_load((CONFIGS.parent / "serve_config.yaml").read_text())["applications"][0]["args"]


def test_serve_config_yaml_uses_the_run_config_sections():
    app = load_app(serve_config_args())
    assert isinstance(app, AppConfig)
    assert app.model.build_tiny and app.model.dtype == "float32" and app.rollout.num_replicas == 2
    assert (app.rollout.width, app.rollout.num_inference_steps, app.serve.max_n) == (64, 4, 16)
    assert app.model.tiny_seed == 0 and app.rollout.max_num_seqs == 1  # schema defaults, settable there too
    assert app.reward.ocr_detect_min_side == RewardConfig().ocr_detect_min_side


def test_a_run_deploys_its_own_sections():
    run = load(CONFIGS / "tiny_cpu.yaml", ["model.tiny_seed=3", "rollout.max_num_seqs=2"])
    app = run.app()
    assert (app.model, app.rollout, app.reward, app.serve) == (run.model, run.rollout, run.reward, run.serve)
    assert app.model.tiny_seed == 3 and app.rollout.max_num_seqs == 2


@pytest.mark.parametrize("change,match", [
    ({"rollout": {"num_replicas": "two"}}, "rollout.num_replicas"),
    ({"rollout": {"engine": "vllm"}}, "rollout.engine"),
    ({"serve": {"max_sides": 512}}, "serve.max_sides"),
    ({"model_path": "x"}, "model_path"),  # the old flat keys are refused, by name
    ({"serve": {"max_side": 32}}, "serve.max_side=32 is below rollout's 64x64"),
    ({"serve": {"max_steps": 2}}, "raise serve.max_steps"),
    ({"reward": {"max_batch_size": 0}}, "reward.max_batch_size=0"),
    ({"serve": {"log_level": "LOUD"}}, "serve.log_level"),
    ({"model": {"attention_kernels": ["flash"]}}, r"add math, the fallback .* e.g. \[flash, math\]"),
    ({"model": {"attention_kernels": ["fa3", "math"]}}, "name one or more of"),
])
def test_bad_app_args_name_the_key(change, match):
    args = serve_config_args()
    for section, values in change.items():
        args[section] = {**args[section], **values} if isinstance(values, dict) and section in args else values
    with pytest.raises(ConfigError, match=match):
        load_app(args)


def test_reward_weights_in_app_args_replace_the_default():
    app = load_app({**serve_config_args(), "reward": {"weights": {"jpeg_compressibility": 1.0}}})
    assert app.reward.weights == {"jpeg_compressibility": 1.0}


def test_a_request_gets_the_rollout_section_s_sampling_unless_it_says_otherwise():
    rollout = RolloutConfig(group_size=4, height=64, width=128, num_inference_steps=3, noise_level=0.5,
                            sde_type="cps")
    request = rollout.request("a sign", seed=1)
    assert (request.n, request.height, request.width, request.num_inference_steps) == (4, 64, 128, 3)
    assert (request.noise_level, request.sde_type, request.seed, request.negative_prompt) == (0.5, "cps", 1, None)
    changed = rollout.request("a sign", n=1, num_inference_steps=2, guidance_scale=4.0)
    assert (changed.n, changed.num_inference_steps, changed.negative_prompt) == (1, 2, rollout.negative_prompt)
    with pytest.raises(ValueError, match="^height="):
        rollout.request("a sign", height=100)


def test_bagel_configs_load_with_the_family_s_engine_and_lora_targets():
    from app.models.bagel import GENERATION_TARGETS

    tiny = load(CONFIGS / "tiny_bagel_cpu.yaml")
    assert (tiny.model.family, tiny.rollout.engine) == ("bagel", "bagel")
    assert tiny.model.lora_targets == GENERATION_TARGETS  # no targets in the YAML: the family's
    assert load(CONFIGS / "tiny_cpu.yaml").model.lora_targets[0] == "to_q"
    with pytest.raises(ConfigError, match="model.path"):
        load(CONFIGS / "bagel_ocr.yaml")  # the real checkpoint's folder must be given
    gpu = load(CONFIGS / "bagel_ocr.yaml", ["model.path=/data/BAGEL-7B-MoT"])
    request = gpu.rollout.request('a sign that says "OPEN"')
    assert (request.guidance_scale, request.negative_prompt, request.cfg_interval) == (4.0, "", (0.0, 1.0))
    with pytest.raises(ConfigError, match="rollout.engine=diffusers cannot run model.family=bagel"):
        load(CONFIGS / "tiny_bagel_cpu.yaml", ["rollout.engine=diffusers"])
    with pytest.raises(ConfigError, match="rollout.cfg_interval"):
        load(CONFIGS / "tiny_bagel_cpu.yaml", ["rollout.cfg_interval=[0.5,0.2]"])
    # vllm-omni runs BAGEL in bf16: its log-probs are recomputed, and a config must say so
    with pytest.raises(ConfigError, match="train.old_logprob=trainer or recompute"):
        load(CONFIGS / "tiny_bagel_cpu.yaml", ["rollout.engine=vllm_omni"])
    served = load(CONFIGS / "tiny_bagel_cpu.yaml", ["rollout.engine=vllm_omni", "train.old_logprob=recompute"])
    assert served.rollout.engine == "vllm_omni"


def test_compile_needs_old_log_probs_from_the_trainer_and_its_settings_are_checked():
    tiny = CONFIGS / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="model.compile.enabled.*train.old_logprob=trainer"):
        load(tiny, ["model.compile.enabled=true"])
    compiled = load(tiny, ["model.compile.enabled=true", "train.old_logprob=trainer", "train.max_staleness=1",
                           "model.compile.mode=max-autotune-no-cudagraphs"])
    assert compiled.model.compile.mode == "max-autotune-no-cudagraphs" and compiled.train.max_staleness == 1
    assert load(tiny, ["model.compile.enabled=true", "train.old_logprob=recompute"]).model.compile.enabled
    with pytest.raises(ConfigError, match="model.compile.mode"):
        load(tiny, ["model.compile.mode=fastest"])
    bagel = ["model.family=bagel", "rollout.engine=bagel", "train.old_logprob=trainer", "model.path=/nonexistent"]
    with pytest.raises(ConfigError, match="model.family=bagel keeps that across forwards.*use default"):
        load(tiny, [*bagel, "model.compile.mode=reduce-overhead"])
    assert load(tiny, [*bagel, "model.compile.mode=max-autotune-no-cudagraphs"]).model.family == "bagel"
    with pytest.raises(ConfigError, match="num_inner_epochs=2.*recompute"):
        load(tiny, ["train.old_logprob=trainer", "train.num_inner_epochs=2"])
    with pytest.raises(ConfigError, match="max_staleness=1.*rollout or trainer"):
        load(tiny, ["train.old_logprob=recompute", "train.max_staleness=1"])
    with pytest.raises(ConfigError, match="activation_memory_budget=0.5.*model.compile.enabled"):
        load(tiny, ["train.activation_memory_budget=0.5"])
    with pytest.raises(ConfigError, match="activation_memory_budget=0.5.*gradient_checkpointing off"):
        load(tiny, ["model.compile.enabled=true", "train.old_logprob=trainer", "train.activation_memory_budget=0.5",
                    "train.gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match="behaviour_weight_max"):
        load(tiny, ["train.behaviour_weight_max=0.5"])
    gpu = load(CONFIGS / "qwen_image_ocr_2gpu.yaml", ["model.path=/data/qwen-image"])
    assert gpu.model.compile.enabled and gpu.train.old_logprob == "trainer"


def test_a_compiled_run_caches_its_graphs_in_its_folder(tmp_path):
    from jobs.train import checked_config, parse_args

    model = tmp_path / "model"
    from app.models.qwen_image.tiny import build_tiny_qwen_image

    build_tiny_qwen_image(model, seed=0)
    args = parse_args(["--config", str(CONFIGS / "tiny_cpu.yaml"), f"model.path={model}", "model.compile.enabled=true",
                       "train.old_logprob=trainer", f"logging.dir={tmp_path / 'run'}"])
    config, run_dir = checked_config(args)
    assert config.model.compile.cache_dir == str(run_dir / "compile_cache")
    args = parse_args(["--config", str(CONFIGS / "tiny_cpu.yaml"), f"model.path={model}", "model.compile.enabled=true",
                       "train.old_logprob=trainer", f"logging.dir={tmp_path / 'run2'}",
                       f"model.compile.cache_dir={tmp_path / 'shared'}"])
    assert checked_config(args)[0].model.compile.cache_dir == str(tmp_path / "shared")


def test_the_sd35_medium_recipes_are_flow_grpo_s():
    """flow_grpo's SD3.5-M OCR recipe (config/grpo.py general_ocr_sd3) and its fast no-CFG variant with a window of
    2; both need the paths a user names."""
    with pytest.raises(ConfigError, match="model.path"):
        load(CONFIGS / "sd35m_ocr.yaml")
    paths = ["model.path=/models/sd35m", "data.prompts=/data/ocr.txt"]
    full, fast = load(CONFIGS / "sd35m_ocr.yaml", paths), load(CONFIGS / "sd35m_ocr_fast.yaml", paths)
    for cfg in (full, fast):
        assert cfg.model.family == "sd3" and (cfg.model.lora_rank, cfg.model.lora_alpha) == (32, 64)
        assert (cfg.rollout.height, cfg.rollout.width, cfg.rollout.num_inference_steps) == (512, 512, 10)
        assert cfg.rollout.group_size == 24 and cfg.train.learning_rate == 3e-4 and cfg.model.compile.enabled
    assert (full.rollout.guidance_scale, full.rollout.noise_level, full.train.kl_beta) == (4.5, 0.7, 0.04)
    assert full.model.lora_targets == list(get_family("sd3").lora_targets)
    assert fast.rollout.guidance_scale == 1.0 and fast.rollout.sde_window.size == 2 and fast.rollout.sde_type == "cps"


def test_the_one_gpu_plan_fits_one_gpu_and_16_cpus_and_the_8_gpu_recipe_does_not():
    """`RunConfig.resources` adds up what jobs.train reserves; the job refuses a local cluster it cannot fit
    (jobs/train.py `resource_shortfall`). docs/perf/sd3/gpu_runs.sh's one-GPU overrides fit the lent machine."""
    from jobs.train import resource_shortfall

    one_gpu = ["model.path=/models/sd35m", "data.prompts=ocr_tiny", "rollout.num_replicas=1",
               "rollout.replica_num_gpus=0.5", "rollout.replica_num_cpus=2", "cluster.num_workers=1",
               "cluster.worker_num_gpus=0.5", "reward.num_replicas=2", "reward.replica_num_cpus=2"]
    machine = {"CPU": 16.0, "GPU": 1.0}
    planned = load("configs/sd35m_ocr.yaml", one_gpu).resources()
    assert sum(p["CPU"] for p in planned.values()) == 2 + 4 + 0.25 + 4
    assert sum(p.get("GPU", 0) for p in planned.values()) == 1.0
    assert resource_shortfall(load("configs/sd35m_ocr.yaml", one_gpu), machine) is None
    message = resource_shortfall(load("configs/sd35m_ocr.yaml", one_gpu[:2]), machine)
    assert ("8 GPUs (rollout (4 x rollout.replica_num_cpus/gpus/resources) 4, training (4 x "
            "cluster.worker_num_cpus/gpus/resources) 4)") in message
    assert "48.25 CPUs" in message and "but the cluster has 1:" in message


def test_custom_resources_keep_the_halves_on_their_nodes_and_are_checked():
    """`rollout.replica_resources` and `cluster.worker_resources` reserve custom Ray resources per replica and per
    worker (nodes started with `ray start --resources=...`); the start-up check counts them like CPUs."""
    from jobs.train import resource_shortfall

    two_nodes = ["rollout.replica_resources={rollout_node: 1}", "cluster.worker_resources={trainer_node: 0.5}"]
    config = load(CONFIGS / "tiny_cpu.yaml", two_nodes)
    parts = config.resources()
    assert parts["rollout (2 x rollout.replica_num_cpus/gpus/resources)"]["rollout_node"] == 2
    assert parts["training (2 x cluster.worker_num_cpus/gpus/resources)"]["trainer_node"] == 1
    cluster = {"CPU": 4.0, "rollout_node": 100.0, "trainer_node": 100.0}
    assert resource_shortfall(config, cluster) is None
    message = resource_shortfall(config, {"CPU": 4.0, "rollout_node": 100.0})
    assert ("1 'trainer_node's (training (2 x cluster.worker_num_cpus/gpus/resources) 1) but the cluster has 0"
            in message)
    with pytest.raises(ConfigError, match="cluster.worker_resources: CPU is not a custom resource; set "
                                          "cluster.worker_num_cpus instead"):
        load(CONFIGS / "tiny_cpu.yaml", ["cluster.worker_resources={CPU: 1}"])
    with pytest.raises(ConfigError, match="rollout.replica_resources: rollout_node=0.0 must be > 0"):
        load(CONFIGS / "tiny_cpu.yaml", ["rollout.replica_resources={rollout_node: 0}"])
