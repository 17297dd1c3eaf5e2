"""``rollout-fleet generate``: rollouts for the prompts of a JSONL file, results to JSONL.

Each input line is ``{"prompt_token_ids": [...]}`` or ``{"text": "..."}`` (text needs
``--tokenizer``), with optional ``id``, ``stop_strings`` and ``max_new_tokens``. Each output line
holds the id, the generated token IDs, one logprob per token, the finish reason, and the text
when a tokenizer was given. Rollouts go through the core's RolloutClient (with retries) over the
http transport. A prompt that still fails gets an error line instead (its id, its index and the
error); the command then exits non-zero, after writing every line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from rollout_fleet.core.errors import InvalidValue, RolloutFleetError
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec
from rollout_fleet.core.validate import check_int_at_least, is_int
from rollout_fleet.wiring.cli_args import add_frontend_url, documented_command
from rollout_fleet.wiring.progress import progress_bar

_LINE_KEYS = {"prompt_token_ids", "text", "id", "stop_strings", "max_new_tokens"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    generate = documented_command(commands, "generate", doc=__doc__,
                                  summary="rollouts for prompts from a JSONL file")
    add_frontend_url(generate)
    generate.add_argument("--prompts", required=True, help="input JSONL file, one prompt a line")
    generate.add_argument("--out", default=None, help="output JSONL file (default: stdout)")
    generate.add_argument("--fleet-file", default=None,
                          help="a fleet file written by `serve`: join its network namespace, and "
                               "take the URL, model name and limits from it")
    generate.add_argument("--model", default=None, help="served model name (default: the fleet "
                                                        "file's, else 'tiny')")
    generate.add_argument("--max-new-tokens", type=int, default=None,
                          help="token budget per prompt (default: the fleet file's, else 64)")
    generate.add_argument("--max-model-len", type=int, default=None,
                          help="the model's context length (default: the fleet file's, else 512)")
    generate.add_argument("--greedy", action="store_true", help="greedy decoding (default: sample)")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--tokenizer", default=None,
                          help="a model folder with tokenizer.json: encodes text prompts and "
                               "adds the generated text to each result")
    generate.add_argument("--concurrency", type=int, default=64, help="rollouts in flight (64)")
    generate.add_argument("--no-logprobs", action="store_true",
                          help="ask for no logprobs (the engine computes none; each line's "
                               "logprobs is null)")
    generate.add_argument("--quiet", action="store_true",
                          help="no progress bar (there is none when stderr is not a terminal)")
    generate.set_defaults(run=run_generate)


@attrs.frozen
class Prompt:
    id: str
    token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] | None
    max_new_tokens: int | None


def run_generate(args: argparse.Namespace) -> int:
    fleet = None
    if args.fleet_file:
        from rollout_fleet.wiring.fleet_file import FleetFile, check_fleet_running

        fleet = FleetFile.read(args.fleet_file)
        check_fleet_running(fleet)
    url = args.url or (fleet.frontend_url if fleet else None)
    if url is None:
        raise InvalidValue("--url", None, "is required (or give --fleet-file)")
    for flag in ("max_new_tokens", "max_model_len", "concurrency"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InvalidValue("--" + flag.replace("_", "-"), value, "must be >= 1")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = read_prompts(args.prompts, tokenizer)
    sampling = SamplingSpec(greedy=args.greedy, seed=args.seed)
    progress = progress_bar(len(prompts), desc="generate", unit="rollout",  # none in CI logs
                            shown=not args.quiet and sys.stderr.isatty())
    try:
        results = asyncio.run(_rollouts(
            url, prompts, sampling, args.concurrency, done=progress.update,
            model=args.model or (fleet.served_model_name if fleet else "tiny"),
            max_new_tokens=args.max_new_tokens or (fleet.max_new_tokens if fleet else 64),
            max_model_len=args.max_model_len or (fleet.max_model_len if fleet else 512),
            logprobs=not args.no_logprobs))
    finally:
        progress.close()
    failed = [(i, p, r) for i, (p, r) in enumerate(zip(prompts, results))
              if isinstance(r, BaseException)]
    lines = [json.dumps(_error_line(i, p, r) if isinstance(r, BaseException)
                        else _result_line(p, r, tokenizer)) + "\n"
             for i, (p, r) in enumerate(zip(prompts, results))]
    where = args.out or "stdout"
    if args.out:
        try:
            Path(args.out).write_text("".join(lines))
        except OSError as exc:
            raise InvalidValue("--out", args.out, f"cannot be written: {exc.strerror}") from None
    else:
        sys.stdout.writelines(lines)
        sys.stdout.flush()
    if failed:
        index, prompt, error = failed[0]
        raise PromptsFailed(
            f"{len(failed)} of {len(prompts)} prompts failed ({len(prompts) - len(failed)} "
            f"results and {len(failed)} error lines written to {where}); first: prompt "
            f"{prompt.id!r} (index {index}): {type(error).__name__}: {error}")
    if args.out:
        print(f"{len(lines)} results written to {args.out}", file=sys.stderr)
    return 0


class PromptsFailed(RolloutFleetError):
    """Some prompts got no result (each has its error line in the output)."""


def load_tokenizer(folder: str):
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise InvalidValue("--tokenizer", folder, "has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
        raise InvalidValue("--tokenizer", str(path), f"cannot be loaded: {exc}") from None


def read_prompts(path: str, tokenizer: Any) -> list[Prompt]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidValue("--prompts", path, f"cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidValue("--prompts", path, f"is not UTF-8 text: {exc.reason}") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(_parse_line(line, f"{path} line {number}", len(prompts), tokenizer))
    if not prompts:
        raise InvalidValue("--prompts", path, "holds no prompts")
    return prompts


def _parse_line(line: str, where: str, index: int, tokenizer: Any) -> Prompt:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise InvalidValue(where, line[:80], f"is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidValue(where, line[:80], "must be a JSON object")
    unknown = sorted(set(data) - _LINE_KEYS)
    if unknown:
        raise InvalidValue(f"{where}: {unknown[0]}", data[unknown[0]],
                           f"unknown key; known: {sorted(_LINE_KEYS)}")
    if ("prompt_token_ids" in data) == ("text" in data):
        raise InvalidValue(where, line[:80], "needs exactly one of prompt_token_ids or text")
    if "text" in data:
        if not isinstance(data["text"], str) or not data["text"]:
            raise InvalidValue(f"{where}: text", data["text"], "must be a non-empty string")
        if tokenizer is None:
            raise InvalidValue(f"{where}: text", data["text"][:40], "needs --tokenizer to encode it")
        token_ids = tokenizer.encode(data["text"]).ids
    else:
        token_ids = data["prompt_token_ids"]
    try:  # the same checks a request gets, named by line
        request = RolloutRequest(request_id="check", prompt_token_ids=token_ids, max_new_tokens=1,
                                 stop_strings=data.get("stop_strings", ()))
    except InvalidValue as exc:
        raise InvalidValue(f"{where}: {exc.field}", exc.value, exc.rule) from None
    budget = data.get("max_new_tokens")
    if budget is not None:
        check_int_at_least(f"{where}: max_new_tokens", budget, 1)
    prompt_id = data.get("id", index)
    if not (is_int(prompt_id) or (isinstance(prompt_id, str) and prompt_id)):
        raise InvalidValue(f"{where}: id", prompt_id, "must be a non-empty string or an int")
    return Prompt(str(prompt_id), request.prompt_token_ids,
                  request.stop_strings if "stop_strings" in data else None, budget)


async def _rollouts(url: str, prompts: list[Prompt], sampling: SamplingSpec, concurrency: int, *,
                    model: str, max_new_tokens: int, max_model_len: int, logprobs: bool = True,
                    done=None) -> list:
    """One entry per prompt, in order: its RolloutResult, or the error that ended it (after
    the client's retries); a bad prompt fails the whole command before anything is sent."""
    from rollout_fleet.core.errors import RolloutFleetError
    from rollout_fleet.core.rollout_client import RolloutLimits
    from rollout_fleet.wiring.driver import build_frontend_client

    limits = RolloutLimits(max_model_len=max_model_len, max_new_tokens=max_new_tokens)
    requests = [_request(limits, prompt, sampling, logprobs) for prompt in prompts]
    concurrency = min(concurrency, len(prompts))
    frontend = build_frontend_client(url, model=model, max_in_flight=concurrency)
    gate = asyncio.Semaphore(concurrency)

    async def one(request):
        try:
            async with gate:
                return await frontend.client.rollout(request)
        except RolloutFleetError as exc:  # this prompt failed; the others go on
            return exc
        finally:
            if done is not None:
                done(1)

    try:
        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    finally:
        await frontend.aclose()


def _request(limits: Any, prompt: Prompt, sampling: SamplingSpec,
             logprobs: bool = True) -> RolloutRequest:
    try:
        return limits.request(f"generate-{prompt.id}", prompt.token_ids, sampling=sampling,
                              stop_strings=prompt.stop_strings,
                              max_new_tokens=prompt.max_new_tokens, logprobs=logprobs)
    except InvalidValue as exc:
        raise InvalidValue(f"prompt {prompt.id!r}: {exc.field}", exc.value, exc.rule) from None


def _error_line(index: int, prompt: Prompt, error: BaseException) -> dict[str, Any]:
    return {"id": prompt.id, "index": index, "error": f"{type(error).__name__}: {error}"}


def _result_line(prompt: Prompt, result: Any, tokenizer: Any) -> dict[str, Any]:
    logprobs = None if result.logprobs is None else list(result.logprobs)
    line = {"id": prompt.id, "token_ids": list(result.token_ids), "logprobs": logprobs,
            "finish_reason": result.finish_reason.value}
    if result.weight_version is not None:
        line["weight_version"] = result.weight_version
    if result.weight_versions:  # [[version, n_tokens], ...]: which weights sampled each token
        line["weight_versions"] = [list(run) for run in result.weight_versions]
    if tokenizer is not None:
        line["text"] = tokenizer.decode(list(result.token_ids), skip_special_tokens=True)
    return line

