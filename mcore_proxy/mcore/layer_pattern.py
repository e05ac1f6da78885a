"""Megatron/MindSpeed layer patterns (`moe_layer_freq`, `linear_attention_freq`, ...) without eval.

Megatron's `moe_freq_type` accepts an int N (every N-th layer), the same int as a string, or a
string holding a Python list expression such as `"[0]*3+[1]*58"` or `"([1]*3+[0])*4"`, which it
evaluates with `eval`. Strings in a checkpoint's `args` come from whoever made the file, so here
one small recursive-descent parser accepts exactly that language and nothing else:

    expr   := term ('+' term)*
    term   := factor ('*' INT)* | INT '*' factor
    factor := '[' [INT (',' INT)* [',']] ']' | '(' expr ')'

The result is an int (a frequency) or a list of ints (one per layer). Anything else, and
patterns longer than `MAX_LAYERS` or nested deeper than `MAX_DEPTH`, is refused with one sentence.
"""

from __future__ import annotations

import re

from mcore_proxy.core.errors import CheckpointError

MAX_LAYERS = 100_000  # no real model has more layers; bounds memory for "[0]*10**9"-like input
MAX_DEPTH = 32  # parenthesis nesting
MAX_TEXT = 100_000  # characters

_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


class _Parser:
    def __init__(self, text: str, what: str):
        self.what, self.text = what, text
        self.tokens: list[str] = []
        for m in _TOKEN.finditer(text):
            if m.group(1) is not None:
                self.tokens.append(m.group(1))
            elif m.group(2) is not None and not m.group(2).isspace():
                if m.group(2) not in "[](),+*":
                    raise self.error(f"character {m.group(2)!r} is not allowed")
                self.tokens.append(m.group(2))
        self.pos, self.depth = 0, 0

    def error(self, why: str) -> CheckpointError:
        shown = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        return CheckpointError(
            f"{self.what} {shown!r} is not a layer pattern ({why}); Megatron accepts an "
            "int or list arithmetic such as \"[0]*3+[1]*58\", fix the args"
        )

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise self.error(f"expected {expected or 'more'} at token {self.pos}, found {tok or 'the end'}")
        self.pos += 1
        return tok

    def int_token(self) -> int:
        tok = self.take()
        if not tok.isdigit():
            raise self.error(f"expected a number at token {self.pos - 1}, found {tok!r}")
        return int(tok)

    def checked(self, items: list[int]) -> list[int]:
        if len(items) > MAX_LAYERS:
            raise self.error(f"more than {MAX_LAYERS} entries")
        return items

    def expr(self) -> list[int]:
        items = self.term()
        while self.peek() == "+":
            self.take("+")
            items = self.checked(items + self.term())
        return items

    def term(self) -> list[int]:
        if self.peek() is not None and self.peek().isdigit():  # INT '*' factor
            count = self.int_token()
            self.take("*")
            return self.repeat(self.factor(), count)
        items = self.factor()
        while self.peek() == "*":
            self.take("*")
            items = self.repeat(items, self.int_token())
        return items

    def repeat(self, items: list[int], count: int) -> list[int]:
        if len(items) * count > MAX_LAYERS:  # checked before the list is built
            raise self.error(f"more than {MAX_LAYERS} entries")
        return items * count

    def factor(self) -> list[int]:
        tok = self.peek()
        if tok == "(":
            self.take("(")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise self.error(f"nested deeper than {MAX_DEPTH}")
            items = self.expr()
            self.take(")")
            self.depth -= 1
            return items
        self.take("[")
        items: list[int] = []
        while self.peek() != "]":
            items.append(self.int_token())
            if self.peek() == ",":
                self.take(",")
            elif self.peek() != "]":
                raise self.error(f"expected ',' or ']' at token {self.pos}, found {self.peek() or 'the end'}")
        self.take("]")
        return self.checked(items)


def parse_layer_pattern(value, what: str = "layer pattern") -> int | list[int] | None:
    """An args layer pattern as Megatron reads it: None, an int, or a list of ints.

    `what` names the field (and file) in the message; CheckpointError on anything else.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LAYERS or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise CheckpointError(
                f"{what} is a list that is not all integers (or longer than {MAX_LAYERS}); fix the args"
            )
        return list(value)
    if not isinstance(value, str):
        raise CheckpointError(
            f"{what} holds a {type(value).__name__}, not an int, a list or a pattern string; fix the args"
        )
    if len(value) > MAX_TEXT:
        raise CheckpointError(
            f"{what} is a string of {len(value)} characters, too long for a layer pattern; fix the args"
        )
    text = value.strip()
    if text.isdigit():
        return int(text)
    parser = _Parser(text, what)
    if not parser.tokens:
        raise parser.error("it is empty")
    items = parser.expr()
    if parser.peek() is not None:
        raise parser.error(f"unexpected {parser.peek()!r} at token {parser.pos}")
    return items
