from servetune.cli.main import main

raise SystemExit(main())
