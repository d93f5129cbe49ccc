"""Privacy audits of a run's configuration: ε lower bounds measured with canaries, next to the ε it reports.

``audit_step`` (white-box, many one-step trials) and ``audit_one_run`` (Steinke, Nasr, Jagielski 2023) take the
user's ``DPTrainingArguments``, a model factory, data and trainer class; ``python -m hf_dp.audit`` does the same
from the command line. See docs/audit.md.
"""

from hf_dp.audit.runs import OneRunAudit, StepAudit, audit_one_run, audit_step

__all__ = ["OneRunAudit", "StepAudit", "audit_one_run", "audit_step"]
