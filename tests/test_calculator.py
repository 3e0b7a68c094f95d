"""The calculator tool (common/calculator.py): exact values, errors as observations, and no
input that makes it raise, run code or work without bound."""

import random
import time

import pytest

from common.calculator import calculate


@pytest.mark.parametrize("expression, value", [
    ("5535", "5535"),
    ("1+2*3", "7"),                  # * before +
    ("(1+2)*3", "9"),
    ("10-4-3", "3"),                 # left-associative
    ("64/4/2", "8"),
    ("2*3+4*5", "26"),
    ("-12", "-12"),
    ("3 - -2", "5"),
    ("--3", "3"),
    ("+4", "4"),
    ("-(2*(3+4))/7", "-2"),
    ("((1)+(2))*-(3)", "-9"),
    (" 12 *\t( 3 + 4 ) ", "84"),
    ("3.5*2", "7"),
    (".5+.25", "0.75"),
    ("7.", "7"),
    ("0.1+0.2", "0.3"),              # exact: no 0.30000000000000004
    ("5/2", "2.5"),
    ("1/3", "0.3333333333"),         # 10 significant digits
    ("2/3", "0.6666666667"),
    ("-1/3", "-0.3333333333"),
    ("1/7", "0.1428571429"),
    ("2/3*3", "2"),                  # exact fractions, not rounded floats
    ("1/8", "0.125"),
    ("0.0001/3", "0.00003333333333"),
    ("999999999999999999999999999999", "999999999999999999999999999999"),  # 30 digits: allowed
    ("((((((((((((((((((((1))))))))))))))))))))", "1"),                      # 20 levels: allowed
])
def test_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("", "error: empty expression"),
    ("   ", "error: empty expression"),
    ("1+", "error: unexpected end of expression"),
    ("(1", "error: unexpected end of expression"),
    ("1)", "error: unexpected ')' at 1"),
    ("(1+2))", "error: unexpected ')' at 5"),
    ("()", "error: unexpected ')' at 1"),
    ("1 2", "error: unexpected '2' at 2"),
    ("abc", "error: unexpected 'a' at 0"),
    ("2**3", "error: unexpected '*' at 2"),   # no power operator
    ("1.5.2", "error: unexpected '.' at 3"),
    (".", "error: unexpected '.' at 0"),
    ("1/0", "error: division by zero"),
    ("1/(2-2)", "error: division by zero"),
    ("0/0.0", "error: division by zero"),
    ("9" * 31, "error: number too large"),
    ("0." + "0" * 29 + "1", "error: number too large"),            # denominator 10^30: 31 digits
    ("99999999999*99999999999*99999999999", "error: number too large"),  # an intermediate value
    ("(" * 21 + "1" + ")" * 21, "error: nesting deeper than 20"),
    ("-" * 21 + "1", "error: nesting deeper than 20"),
    ("1+" * 100 + "1", "error: expression too long (over 200 characters)"),
])
def test_errors(expression, error):
    assert calculate(expression) == error


@pytest.mark.parametrize("expression", [
    "__import__('os').system('ls')",
    "9" * 500,
    "(" * 10000 + "1" + ")" * 10000,
    "1" + "*99999999" * 10,
    "(" * 100 + "1",
    "-" * 199 + "1",
    "nan", "inf", "-inf", "1e999", "1_000", "0x10", "True", "None",
    "١٢", "²", "1²", "١+١", "\x00", "1\x00", "\ud800", "1/\u200b2",
])
def test_hostile_inputs_are_answered_with_an_error(expression):
    assert calculate(expression).startswith("error: ")


def test_no_input_makes_it_raise_or_run_long():
    rng = random.Random(0)
    alphabet = "0123456789+-*/().  eE_x١²\n"
    start = time.perf_counter()
    for _ in range(3000):
        expression = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 250)))
        answer = calculate(expression)
        assert isinstance(answer, str) and answer
        if not answer.startswith("error: "):
            assert calculate(answer) == answer  # a value reads back as itself
    assert time.perf_counter() - start < 5
    assert calculate(None).startswith("error: ")  # not even for a non-string


@pytest.mark.parametrize("sevens", [10, 20, 25, 30, 35])
def test_a_tiny_quotient_reads_back(sevens):
    """1/7/.../7 is below 1e-21 with 25 sevens: 10 significant digits of it in plain notation would need
    more than 29 decimal places (a denominator over 30 digits), a literal the calculator refuses; the answer
    keeps 29 at most."""
    answer = calculate("/".join(["1"] + ["7"] * sevens))
    assert not answer.startswith("error: "), answer
    assert calculate(answer) == answer
    assert len(answer.partition(".")[2]) <= 29
