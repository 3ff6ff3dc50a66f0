"""The tool demo's warm start: its rows are exactly what the agent loop produces on the calculator path,
its loss weights teach the tool path and not the decision, and ``demo-tools`` resolves to it.

The fit shows the policy conversations in the agent loop's own token layout: an engine that writes
the fitted call turn and answer turn, run through :class:`~mindspeed_rl.rollout.agent.AgentLoop` with
the real calculator, gives the fitted row's ids token for token, with the loss mask equal to the
fit's labels (1 where the fit teaches, 0 on the prompt and the appended tool response).
"""

from __future__ import annotations

from pathlib import Path

from mindspeed_llm.engine import GenerationOutput, SamplingParams
from mindspeed_rl.data import load_prompts
from mindspeed_rl.demo.tools_model import CALL_HEAD, CALL_TAIL, _row, build_tools_tokenizer
from mindspeed_rl.rollout.agent import AgentLoop, AgentSettings
from mindspeed_rl.tools import build_tools, tool_schemas


def test_fitted_rows_are_the_agent_loops_layout() -> None:
    tokenizer = build_tools_tokenizer()
    tools = build_tools(["calculator"])
    loop = AgentLoop(tokenizer, AgentSettings(tools, max_turns=2, max_response_length=64))
    assert loop.close_id == tokenizer.convert_tokens_to_ids("</tool_call>")
    records = load_prompts("demo-products-test")[:4]
    for record in records:
        ids, labels = _row(tokenizer, record.prompt, record.reference, True, tool_schemas(tools))
        direct_ids, _ = _row(tokenizer, record.prompt, record.reference, False, tool_schemas(tools))
        conversation = [{"role": "user", "content": record.prompt}]
        prompt = tokenizer(loop.prompt_text(conversation), add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt)] == prompt == direct_ids[: len(prompt)]
        expression = record.prompt.removeprefix("What is ").removesuffix("?")
        value = record.reference.rsplit("#### ", 1)[1]
        turns = iter(["<tool_call>" + CALL_HEAD + expression + CALL_TAIL + "</tool_call>", f" #### {value}</s>"])

        def engine(prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
            out = tokenizer(next(turns), add_special_tokens=False)["input_ids"]
            return [GenerationOutput(prompts[0], out, [-0.5] * len(out), "stop")]

        (got,) = loop.generate(engine, [prompt], [SamplingParams(max_new_tokens=32)], [conversation])
        assert (got.finish_reason, got.tool_calls, dict(got.tool_errors)) == ("stop", 1, {})
        assert got.messages[1] == {"role": "tool", "content": value}, "the calculator computed the product"
        assert prompt + got.token_ids == ids
        assert got.loss_mask == [int(label != -100) for label in labels[len(prompt) :]]
        assert len(ids) < 64, "short sequences: a fast fit and fast rollouts"


def test_fit_weights_the_tool_path_not_the_decision_and_demo_tools_resolves(tmp_path, monkeypatch) -> None:
    import mindspeed_rl.demo.tools_model as tools_model
    from mindspeed_rl.demo.model import DemoPolicySettings, resolve_model

    tokenizer = build_tools_tokenizer()
    call = tokenizer("<tool_call>" + CALL_HEAD + "37 * 59" + CALL_TAIL + "</tool_call>", add_special_tokens=False)
    assert len(call["input_ids"]) == 9, "the call's fixed text is one token each"
    settings = tools_model.ToolDemoSettings(call_fraction=0.5, call_weight=3.0, direct_weight=0.25)
    records = load_prompts("demo-products-test")[:8]
    ids, target, weight = tools_model._fit_tensors(tokenizer, records, settings)
    for i in range(len(records)):
        learnt = (target[i] != -100).nonzero().flatten()
        assert bool((weight[i][target[i] == -100] == 0).all())
        decision = tokenizer.convert_ids_to_tokens(int(target[i, learnt[0]]))
        assert weight[i, learnt[0]] == 1.0 and decision in ("<tool_call>", " #### ")
        assert set(weight[i, learnt[1:]].tolist()) == {3.0 if decision == "<tool_call>" else 0.25}
    quick = tools_model.ToolDemoSettings(DemoPolicySettings(32, 64, 1, 2, fit_steps=2, batch_size=4))
    real = tools_model.build_tools_policy
    monkeypatch.setattr(
        tools_model, "build_tools_policy", lambda out, seed=0: real(out, "demo-products-test", seed, quick)
    )
    path = resolve_model(tools_model.TOOLS_DEMO_MODEL, tmp_path)
    assert Path(path).name == f"tools-policy-v{tools_model.TOOLS_BUILDER_VERSION}-seed0"
    assert (Path(path) / "config.json").is_file() and resolve_model(tools_model.TOOLS_DEMO_MODEL, tmp_path) == path
