from patchctl.cli import main

raise SystemExit(main())
