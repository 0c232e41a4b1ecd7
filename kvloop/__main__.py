from kvloop.cli import main

raise SystemExit(main())
