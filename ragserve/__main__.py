from ragserve.cli import main

raise SystemExit(main())
