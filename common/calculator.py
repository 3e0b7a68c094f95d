"""The calculator tool of the multi-turn environment: `calculate("12*(3+4)")` -> "84".

A tool never executes model output as code (DESIGN.md section 7): no eval, exec or compile.
The expression is read by the small recursive-descent parser below, for exactly this grammar:

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := ('+' | '-') factor | NUMBER | '(' expr ')'
    NUMBER := ASCII digits with an optional decimal part: 12, 3.5, .5, 7.

Arithmetic is exact (fractions.Fraction) and the work is bounded: at most 200 characters,
nesting (parentheses and unary signs) at most 20 deep, checked before Python's recursion limit
could be, and no value (a literal or an intermediate result) whose numerator or denominator
has more than 30 digits. Whatever the input, the answer is the text the model reads next: the
value ("5535", "-12", "0.3333333333": an integer exactly, else 10 significant digits in plain
decimal notation with at most 29 decimal places, which the calculator can read back), or a message
beginning with "error: ".
"""

from decimal import Context, Decimal
from fractions import Fraction

MAX_LENGTH = 200
MAX_DEPTH = 20
MAX_DIGITS = 30
DIGITS = "0123456789"  # not str.isdigit, which accepts '١' or '²' that int() may reject


class CalculatorError(Exception):
    """A malformed expression or a bound hit; the message is the observation."""


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise CalculatorError("number too large")
    return value


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos, self.depth = text, 0, 0

    def peek(self) -> str:
        """The next character after whitespace, "" at the end."""
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def fail(self):
        char = self.peek()
        raise CalculatorError(f"unexpected {char!r} at {self.pos}" if char else "unexpected end of expression")

    def expr(self) -> Fraction:
        value = self.term()
        while (op := self.peek()) in ("+", "-"):
            self.pos += 1
            right = self.term()
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while (op := self.peek()) in ("*", "/"):
            self.pos += 1
            right = self.factor()
            if op == "/" and right == 0:
                raise CalculatorError("division by zero")
            value = _bounded(value * right if op == "*" else value / right)
        return value

    def factor(self) -> Fraction:
        char = self.peek()
        if char != "" and char in DIGITS + ".":
            return self.number()
        if char not in ("+", "-", "("):
            self.fail()
        self.depth += 1  # a sign or a parenthesis: one level deeper
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
        self.pos += 1
        if char == "(":
            value = self.expr()
            if self.peek() != ")":
                self.fail()
            self.pos += 1
        else:
            value = self.factor() if char == "+" else -self.factor()
        self.depth -= 1
        return value

    def number(self) -> Fraction:
        start = self.pos
        whole = self.digits()
        fraction = ""
        if self.pos < len(self.text) and self.text[self.pos] == ".":
            self.pos += 1
            fraction = self.digits()
        if not whole and not fraction:
            raise CalculatorError(f"unexpected '.' at {start}")
        return _bounded(Fraction(int(whole + fraction), 10 ** len(fraction)))

    def digits(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in DIGITS:
            self.pos += 1
        return self.text[start:self.pos]


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    rounded = Context(prec=10).divide(Decimal(value.numerator), Decimal(value.denominator))
    if rounded.as_tuple().exponent < 1 - MAX_DIGITS:  # a denominator of 10^29 at most: a literal it reads back
        rounded = rounded.quantize(Decimal(1).scaleb(1 - MAX_DIGITS))
        if not rounded:
            return "0"
    text = format(rounded, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or "error: ...", as text; never raises."""
    if not isinstance(expression, str):
        return "error: the expression must be text"
    if len(expression) > MAX_LENGTH:
        return f"error: expression too long (over {MAX_LENGTH} characters)"
    if not expression.strip():
        return "error: empty expression"
    parser = _Parser(expression)
    try:
        value = parser.expr()
        if parser.peek():
            parser.fail()
    except CalculatorError as e:
        return f"error: {e}"
    return _format(value)
