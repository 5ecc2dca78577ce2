from specport.cli import main

raise SystemExit(main())
