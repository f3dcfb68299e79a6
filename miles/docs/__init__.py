"""Documentation that cannot lie: generators for the reference pages and checkers for the prose.

- `miles.docs.model`: plain data describing the CLI (commands, flags, recipes) that the generators
  and checkers read. The CLI layer (`miles_cli/docs_cmd.py`) builds it from the real Typer app, so
  this package never imports the CLI, a recipe, torch or typer.
- `miles.docs.markdown`: the few Markdown facts the checks need (fences, code spans, links, anchors,
  generated blocks).
- `miles.docs.cli_reference`, `miles.docs.envvars`, `miles.docs.hooks`: the generated pages
  `docs/reference/{cli,recipes,env-vars,hooks}.md` and generated blocks in hand-written pages.
- `miles.docs.generate`: every generated file and block, written or compared (stale check).
- `miles.docs.check`: the prose checks; each problem names file:line and what is wrong.

Use it through the CLI: `miles docs generate` rewrites every generated file, `miles docs check`
verifies all pages (exit 1 on any problem). It is not a site builder: `mkdocs build --strict` does that.
"""
