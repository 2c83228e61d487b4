from servetune.cli._main import main

raise SystemExit(main())
