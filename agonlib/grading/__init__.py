"""Graders: the one place a completion is judged right or wrong (training reward and evaluation alike).

* :mod:`.math_grader` — math-verify in killable worker processes (``grade_math``, ``grade_math_batch``);
* :mod:`.code_grader` — programs in a namespaced, resource-limited sandbox (``grade_code``), started
  through :mod:`.launcher`.
"""

from .code_grader import grade_code
from .math_grader import grade_math, grade_math_batch

__all__ = ["grade_code", "grade_math", "grade_math_batch"]
