"""The built-in `calculator` tool: exact arithmetic on one expression, without `eval`.

Integers and decimals, + - * / // % ** and parentheses; the expression is parsed with `ast` and only
those nodes are evaluated, with bounds so that `9**9**9` cannot hang the rollout.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 200
_MAX_EXPONENT = 1000


class CalculatorError(ValueError):
    pass


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if b.denominator != 1 or abs(b) > _MAX_EXPONENT:
                raise CalculatorError(f"exponents must be integers of at most {_MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise CalculatorError("division by zero")
        out = _BIN[type(node.op)](a, b)
        out = Fraction(out)
        if len(str(out.numerator)) > _MAX_DIGITS:
            raise CalculatorError(f"the result has more than {_MAX_DIGITS} digits")
        return out
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}; use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The value of `expression` as text (an integer when it is one, else a decimal); raises CalculatorError."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("give the expression as a non-empty string")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg}") from None
    value = _eval(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))
