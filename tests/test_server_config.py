"""`ninfer serve` flags, YAML args and startup checks: every option lands in ServerConfig, bad values
name their flag, and options this build cannot honour stop startup instead of being ignored."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from server_fixtures import scripted_artifact

from ninfer.chat.ir import Conversation, Message, TextPart
from ninfer.cli import build_parser, main
from ninfer.config import ServerConfig
from ninfer.server.context import build_context
from ninfer.server.launch import config_from_args
from ninfer.server.startup import UnsupportedOptionError, check_implemented, engine_settings

ROOT = Path(__file__).resolve().parents[1]
# The contract's startup example, flag for flag.
REFERENCE = ("models/qwen3_8_27b_nvfp4.ninfer --host 127.0.0.1 --port 8080 --max-context 240000 "
             "--kv-capacity 240000 --max-concurrency 2 --kv-dtype fp8 --device-state-slots 2 "
             "--spec mtp --draft-tokens 3 --lm-head-draft --preserve-thinking").split()


def parse(argv: list[str]) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_every_option_has_a_flag_with_its_default_in_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ServerConfig.model_fields:
        if name == "artifact":
            continue
        assert "--" + name.replace("_", "-") in text, name
    for shown in ("(default: 8192)", "(default: 127.0.0.1)", "(default: 16)", "(default: 30000)", "(default: 384)",
                  "(default: bf16)", "(default: info)"):
        assert shown in text


def test_reference_command_line_maps_onto_the_config():
    cfg = parse(REFERENCE)
    assert (cfg.max_context, cfg.kv_capacity, cfg.max_concurrency, cfg.kv_dtype) == (240000, 240000, 2, "fp8")
    assert (cfg.spec, cfg.draft_tokens, cfg.lm_head_draft, cfg.preserve_thinking) == ("mtp", 3, True, True)
    assert cfg.state_slots == 4  # two lanes plus two extra device slots
    check_implemented(cfg)  # every flag of the example is implemented (the artifact is checked when it exists)
    settings = engine_settings(cfg)
    assert (settings.spec, settings.draft_tokens, settings.lm_head_draft, settings.kv_dtype) == ("mtp", 3, True, "fp8")


def test_defaults_and_sampling_flags_reach_the_engine_settings():
    cfg = parse(["m.ninfer", "--temperature", "0.6", "--top-k", "0", "--seed", "-3", "--greedy", "--no-prefix-reuse",
                 "--host-context-mib", "0", "--default-thinking-budget", "512", "--max-pending-requests", "0",
                 "--no-cuda-graph"])
    settings = engine_settings(cfg)
    assert settings.sampling_overrides == {"temperature": 0.6, "top_k": 0}
    assert (settings.seed, settings.greedy, settings.prefix_reuse, settings.host_context_bytes) == (-3, True, False, 0)
    assert (settings.default_thinking_budget, settings.max_pending_requests, settings.no_cuda_graph) == (512, 0, True)
    assert settings.kv_capacity == settings.max_context == 8192 and settings.state_slots == 2


def test_kv_capacity_auto_reaches_the_engine_unresolved():
    """serving.md, server options: `--kv-capacity N|auto`; auto resolves once, in the engine."""
    cfg = parse(["m.ninfer", "--kv-capacity", "auto", "--max-context", "4096"])
    assert cfg.kv_capacity == "auto" and cfg.resolved_kv_capacity() is None and cfg.max_model_len == 4096
    assert engine_settings(cfg).kv_capacity == "auto"


@pytest.mark.parametrize("argv,flag", [
    (["--max-concurrency", "9"], "--max-concurrency"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--kv-capacity", "lots"], "--kv-capacity"),
    (["--kv-capacity", "0"], "options"),
    (["--port", "70000"], "--port"),
    (["--top-k", "21"], "--top-k"),
    (["--min-p", "1.5"], "--min-p"),
    (["--seed", str(2**63)], "--seed"),  # the sampler keys its noise by a signed 64-bit seed
    (["--default-thinking-budget", "0"], "--default-thinking-budget"),
    (["--spec", "mtp", "--draft-tokens", "6"], "options"),
    (["--draft-tokens", "3"], "options"),
    (["--lm-head-draft"], "options"),
    (["--model-id", ""], "--model-id"),
])
def test_invalid_values_name_their_flag(argv, flag):
    with pytest.raises(SystemExit) as err:
        parse(["m.ninfer", *argv])
    assert str(err.value).startswith("ninfer serve: " + flag)


def test_enum_flags_are_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse(["m.ninfer", "--log-level", "loud"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    ('{"transfer": [{"hardware": "x", "d2h_gib_per_s": 0, "h2d_gib_per_s": 1}]}', "transfer.0.d2h_gib_per_s"),
    ('{"prefill": [{"hardware": "x", "tokens_per_s": 10}]}', "prefill.0.signature"),
    ('{"transfers": []}', "transfers: Extra inputs"),
])
def test_a_malformed_context_cost_registry_aborts_startup(content, message, tmp_path, capsys):
    """Contract, "Server options": a malformed --context-cost-presets file aborts startup, naming what is wrong."""
    presets = tmp_path / "presets.json"
    if content is not None:
        presets.write_text(content)
    assert main(["serve", "m.ninfer", "--context-cost-presets", str(presets)]) == 1
    err = capsys.readouterr().err
    assert "--context-cost-presets" in err and message in err, err


@pytest.mark.parametrize("template,message", [
    (None, "cannot read chat template"),
    ("{% if %}", "does not compile"),
    ("", "non-empty file"),
])
def test_an_unusable_chat_template_stops_startup_before_ray(template, message, tmp_path, capsys):
    """A missing, empty or non-compiling --chat-template is one line naming the option before Ray starts (it was a
    Router replica's traceback, three times, after Ray had started)."""
    path = tmp_path / "template.jinja"
    if template is not None:
        path.write_text(template)
    assert main(["serve", "m.ninfer", "--chat-template", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--chat-template" in err and message in err, err


def test_a_request_log_that_cannot_be_opened_stops_startup_before_ray(capsys):
    """Contract, "Structured request log": failure to open the file aborts startup. /proc refuses a new file even
    to root, whose permissions would let a read-only folder pass."""
    assert main(["serve", "m.ninfer", "--request-log-jsonl", "/proc/ninfer-requests.jsonl"]) == 1
    err = capsys.readouterr().err
    assert "--request-log-jsonl" in err and "cannot open for append" in err, err


def test_an_address_in_use_or_not_this_hosts_stops_startup_before_ray(capsys, artifacts_dir, qwen_tokenizer):
    """A port another process listens on, or a host that is not this machine's, is one line naming the flags (it
    was the Serve proxy's tracebacks after Ray had started)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        artifact = str(scripted_artifact(artifacts_dir, qwen_tokenizer))
        assert main(["serve", artifact, "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert f"--port {port}: cannot listen there" in err and err.count("\n") == 1, err
    assert main(["serve", artifact, "--host", "192.0.2.1"]) == 1  # TEST-NET-1: never this host's
    assert "--host 192.0.2.1" in capsys.readouterr().err


def test_missing_artifact_fails_before_ray_starts(capsys, tmp_path):
    assert main(["serve", str(tmp_path / "none.ninfer")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_missing_artifact_fails_the_serve_build_before_any_replica(tmp_path):
    """`serve run` of a config naming a missing artifact: the application's build fails with the path, once,
    instead of every Engine and Router replica failing in turn."""
    from deployments.app import build_app
    from ninfer.artifact.container import ArtifactError

    with pytest.raises(ArtifactError, match="none.ninfer: file does not exist"):
        build_app({"artifact": str(tmp_path / "none.ninfer")})


def test_yaml_configs_are_valid_server_configs():
    from deployments.app import build_app

    tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    check_implemented(ServerConfig(**tiny["applications"][0]["args"]))
    assert tiny["http_options"] == {"host": "127.0.0.1", "port": 8080}
    for name in ("qwen27b", "qwen35b-a3b"):
        app = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["applications"][0]
        cfg = ServerConfig(**app["args"])
        assert cfg.max_context == cfg.kv_capacity == 240000 and cfg.max_concurrency == 2
        check_implemented(cfg)  # --spec mtp / dflash pass the gate (the artifact is checked when it exists)
    with pytest.raises(ValueError, match="http_options.port"):
        build_app({"artifact": "m.ninfer", "port": 9000})


def test_server_defaults_and_template_override_reach_the_prompt(artifacts_dir, qwen_tokenizer, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                        "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")
    path = scripted_artifact(artifacts_dir, qwen_tokenizer)
    ctx = build_context(ServerConfig(artifact=str(path), no_thinking=True, chat_template=str(template),
                                     model_id="alias"), engine=None)
    assert ctx.model_id == "alias"
    prompt = ctx.frontend.build_prompt(Conversation([Message("user", [TextPart("hi")])]))
    assert prompt.text.endswith("<think>\n\n</think>\n\n") and not prompt.thinking
    with pytest.raises(Exception, match="missing.jinja"):
        build_context(ServerConfig(artifact=str(path), chat_template=str(tmp_path / "missing.jinja")), engine=None)


def test_cli_namespace_round_trip():
    args = argparse.Namespace(artifact="m.ninfer", max_context="1024", cors=True, api_key=None)
    cfg = config_from_args(args)
    assert (cfg.max_context, cfg.cors, cfg.api_key) == (1024, True, None)


def test_api_key_from_the_environment_when_no_flag_or_arg(monkeypatch):
    # serving.md "Authentication and CORS": --api-key sets the required key. Ray Serve logs a YAML
    # application's `args` in clear ("Importing application ... with arguments {...}"), so a Serve
    # config can leave the key out and set NINFER_API_KEY instead (README, --api-key row).
    monkeypatch.setenv("NINFER_API_KEY", "from-env")
    assert parse(["m.ninfer"]).api_key == "from-env"
    assert parse(["m.ninfer", "--api-key", "from-flag"]).api_key == "from-flag"  # the flag wins
    assert ServerConfig(artifact="m.ninfer", api_key="from-yaml").api_key == "from-yaml"
    app_args = {"artifact": "m.ninfer"}
    assert ServerConfig(**app_args).api_key == "from-env" and "api_key" not in app_args
    monkeypatch.setenv("NINFER_API_KEY", "")  # empty: no auth, as unset
    assert parse(["m.ninfer"]).api_key is None
    monkeypatch.delenv("NINFER_API_KEY")
    assert parse(["m.ninfer"]).api_key is None


def test_speculative_options_need_their_components_in_the_artifact(artifacts_dir, tiny_qwen_path):
    """--spec mtp and --lm-head-draft load artifact components (contract: "The artifact need only contain the
    Text backbone and the optional components selected for this process"): one that is missing stops startup
    with the flag and the component named, before any model is loaded."""
    from ninfer.artifact.presets import write_preset
    from ninfer.models.draft_head import add_draft_head

    with pytest.raises(UnsupportedOptionError, match="--spec mtp needs the artifact's 'mtp' component"):
        check_implemented(ServerConfig(artifact=str(tiny_qwen_path), spec="mtp"))
    with_mtp = write_preset("tiny-qwen3.6", artifacts_dir / "startup-mtp.ninfer", mtp=True)
    check_implemented(ServerConfig(artifact=str(with_mtp), spec="mtp", draft_tokens=2))
    with pytest.raises(UnsupportedOptionError, match="--lm-head-draft needs the artifact's 'draft_head'"):
        check_implemented(ServerConfig(artifact=str(with_mtp), spec="mtp", lm_head_draft=True))
    both = add_draft_head(with_mtp, artifacts_dir / "startup-mtp-head.ninfer", num_tokens=512)
    check_implemented(ServerConfig(artifact=str(both), spec="mtp", lm_head_draft=True))
    with pytest.raises(UnsupportedOptionError, match="--spec dflash needs the artifact's 'dflash' component"):
        check_implemented(ServerConfig(artifact=str(both), spec="dflash", draft_tokens=7))
