"""`check`, once for every framework: a candidate trained next to strict fp32, judged, and fixed."""

from mixprec.checking.check import Checker, check, make_checker

__all__ = ["Checker", "check", "make_checker"]
