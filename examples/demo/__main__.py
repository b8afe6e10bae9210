"""``python -m examples.demo`` (what ``./dev demo`` runs), from the repository root."""

from examples.demo.run import main

raise SystemExit(main())
