"""`npllm chat`: a conversation on the terminal, or one user turn per line of a script.

    >>> a user turn               the reply is streamed to stdout
    /reset                        forget the conversation (the system message stays)
    /system TEXT                  set the system message (/system alone removes it)
    /save FILE, /load FILE        the conversation as a JSON list of {"role", "content"} messages
    /help                         these commands
    Ctrl-C                        stops the reply being written (it is kept as far as it went), not the program
    Ctrl-D                        quits

On a terminal, input() has readline's line editing and history (up arrow). With stdin not a terminal, each line is
one user turn (or command), replies go to stdout one per turn, and the first error ends the run with status 2,
so a script sees it; on a terminal an error is shown and the conversation goes on. Timings go to stderr.
"""

from __future__ import annotations

import sys
import time

from ..errors import NpllmError

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system message), /save FILE, "
        "/load FILE, /help; Ctrl-C stops a reply, Ctrl-D quits")


def run(llm, args, params, context: dict, write_out, constraint=None) -> int:
    """The conversation with a loaded llm: args.chat_template, args.system, args.model, args.max_new_tokens as
    `npllm chat` parsed them, params the SamplingParams its flags ask for, context as LLM.stream's keywords,
    write_out(text) the CLI's writer to stdout. The CLI calls this; nothing here imports the CLI."""
    from .session import ChatSession

    session = ChatSession(llm, args.chat_template, args.system, context["context_policy"], context["sinks"])
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (input() gains line editing and history once it is imported)
        except ImportError:
            pass
        print(f"[npllm] chatting with {args.model}; {HELP}", file=sys.stderr)
    for line in user_lines(interactive):
        try:
            if line.startswith("/"):
                command(session, line)
                continue
            reply_to(session, line, args.max_new_tokens, context["ignore_eos"], params, write_out, constraint)
        except NpllmError as e:
            if not interactive:
                raise in_user_terms(e) from None
            print(f"npllm: error: {in_user_terms(e)}", file=sys.stderr)
    return 0


def in_user_terms(e: NpllmError) -> NpllmError:
    """The error as `npllm chat` says it: a conversation that outgrew the context points to /reset and the flags."""
    from ..errors import GenerationError
    from .session import ConversationFull

    if isinstance(e, ConversationFull):
        return GenerationError(e.advice("type /reset to start over", "--context-policy truncate|sinks",
                                        "--max-new-tokens"))
    return e


def user_lines(interactive: bool):
    """The user's lines: input() with a prompt on a terminal (Ctrl-C there just gives a fresh prompt), else stdin's
    lines; blank ones are skipped. Ends at Ctrl-D / the end of stdin."""
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return
        if not interactive and line == "":
            return
        line = line.rstrip("\r\n")
        if line.strip():
            yield line


def reply_to(session, text: str, max_new_tokens: int, ignore_eos: bool, params, write_out, constraint=None) -> None:
    """Stream the reply to one user turn (under `constraint`, a BoundConstraint, where given); Ctrl-C ends the reply
    (kept as far as it went), not the program."""
    start, first, count = time.perf_counter(), None, 0
    before = session.context.prefilled

    def on_step(step) -> None:
        nonlocal first, count
        first = first or time.perf_counter()
        count += 1
        if params.logprobs:
            from ..report import logprobs_line

            print(logprobs_line(session.tokenizer, step), file=sys.stderr)

    reply = session.send(text, max_new_tokens, ignore_eos=ignore_eos, on_step=on_step, params=params,
                         constraint=constraint)
    try:
        for piece in reply:
            write_out(piece)
    except KeyboardInterrupt:
        reply.close()  # the session keeps the reply as far as it went
        write_out(" [interrupted]")
    write_out("\n")
    end = time.perf_counter()
    prefilled = session.context.prefilled - before - max(count - 1, 0)
    print(f"[npllm] {prefilled} prompt tokens prefilled (of {len(session.context.tokens) - max(count - 1, 0)} in "
          f"the conversation), {count} new; first token {1e3 * ((first or end) - start):.1f} ms", file=sys.stderr)


def command(session, line: str) -> None:
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name == "/reset":
        session.reset()
        print("[npllm] conversation reset", file=sys.stderr)
    elif name == "/system":
        session.set_system(rest)
        print(f"[npllm] system message {'set' if rest else 'removed'}", file=sys.stderr)
    elif name in ("/save", "/load") and not rest:
        raise_usage(f"{name} needs a FILE")
    elif name == "/save":
        session.save(rest)
        print(f"[npllm] {len(session.messages)} messages saved to {rest}", file=sys.stderr)
    elif name == "/load":
        session.load(rest)
        print(f"[npllm] {len(session.messages)} messages loaded from {rest}", file=sys.stderr)
    elif name == "/help":
        print(HELP, file=sys.stderr)
    else:
        raise_usage(f"unknown command {name!r}; {HELP}")


def raise_usage(message: str) -> None:
    from ..errors import GenerationError

    raise GenerationError(message)
