"""``python -m torch_mpmd.schedules``: see torch_mpmd.schedules._cli."""

from torch_mpmd.schedules._cli import main

raise SystemExit(main())
