"""A run on a Slurm cluster: `ddloco slurm` (cli.py), its batch scripts (plan.py), the services
job (services.py), its report (report.py), and a one-node Slurm for tests (local.py, check.py)."""
