"""``python -m examples.demo`` (what ``./dev demo`` runs), from the repository root.

What the demo needs is checked before anything is imported or started (``examples.dependencies``): a missing
package would otherwise show only as failing requests, minutes into a run.
"""

import os
import sys

from examples.dependencies import demo_needs, message, missing

gone = missing(demo_needs(os.environ))
if gone:
    print(f"demo: {message('the demo', gone, 'demo')}", file=sys.stderr)
    raise SystemExit(2)

from examples.demo.run import main  # noqa: E402  (imported once its dependencies are known to be there)

raise SystemExit(main())
