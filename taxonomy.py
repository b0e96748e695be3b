"""
The error taxonomy of TRUST-SQL (§3.1): one label per failed final SQL, which eval.py tallies. The labels are
checked in this order:
  generation: no final SQL; syntax: does not parse as one query; hallucination: names a table or column the
  database lacks; syntax: parses but fails to run (incl. timeouts); schema_linking: runs, but touches other
  tables/columns than gold; semantic: right schema, wrong result.
Hallucination is checked before execution because SQLite reports an unknown name as a run error.

    python eval.py --model out/demo/ckpt-000049 --limit 20     # its summary counts each label
"""
import sqlglot
from sqlglot import exp
from sqlglot.optimizer.scope import traverse_scope

from env import run_sql
from rewards import MAX_BARE_JOINS, bare_joins, db_columns, db_schema, extract_schema, sqlite_string_names


def parse_query(sql: str):
    """The single query in sql as a sqlglot tree, or None when it does not parse as exactly one query (or has more
    JOINs without ON/USING than sqlglot parses in reasonable time: rewards.bare_joins)."""
    if bare_joins(sql) > MAX_BARE_JOINS:
        return None
    try:
        trees = [t for t in sqlglot.parse(sql, read="sqlite") if t is not None]
    except (sqlglot.errors.SqlglotError, RecursionError, ValueError):  # model output is untrusted
        return None
    if len(trees) != 1 or not isinstance(trees[0], exp.Query):
        return None  # sqlglot happily parses "SELEC * FRM t" as an arithmetic expression
    return trees[0]


def unknown_names(sql: str, tree, db_path: str) -> list[str]:
    """Tables and columns the query references that do not exist in the database (its sqlglot tree, real schema).
    Columns are resolved per scope against the tables visible there (outer scopes included, for correlated
    subqueries); a scope that also reads a CTE or derived table only needs the name to exist somewhere."""
    schema = db_schema(db_path)
    strings = sqlite_string_names(sql, db_path)  # string literals to SQLite, not names
    known = db_columns(db_path)
    ctes = {cte.alias_or_name.lower() for cte in tree.find_all(exp.CTE)}
    # names a query defines itself: select aliases and CTE/derived-table column lists
    own = {a.alias.lower() for a in tree.find_all(exp.Alias)}
    own |= {c.name.lower() for ta in tree.find_all(exp.TableAlias) for c in ta.columns}
    missing = [f"table {t.name}" for t in tree.find_all(exp.Table)
               if t.name and t.name.lower() not in schema and t.name.lower() not in ctes]
    try:
        scopes = traverse_scope(tree)
    except (sqlglot.errors.SqlglotError, RecursionError):  # cannot scope it: table names were still checked
        scopes = []
    for scope in scopes:
        sources = {}
        s = scope
        while s is not None:  # innermost definition of an alias wins
            for alias, src in s.sources.items():
                sources.setdefault(alias.lower(), src)
            s = s.parent
        real = {a: src.name.lower() for a, src in sources.items()
                if isinstance(src, exp.Table) and src.name.lower() in schema}
        derived = len(real) < len(sources)  # CTE, derived table or an unknown table (already reported)
        visible = known if derived else set().union(*(schema[t] for t in real.values()))
        for col in scope.columns:
            # a scope also lists the columns of its subqueries; check each in its own (innermost) SELECT only
            if isinstance(col.this, exp.Star) or col.find_ancestor(exp.Select) is not scope.expression:
                continue
            name = col.name.lower()
            qual = col.table.lower()
            if qual:
                if qual in real and name not in schema[real[qual]]:
                    missing.append(f"column {col.sql()}")
                elif qual not in sources:
                    missing.append(f"table {col.table} (in {col.sql()})")
            elif name not in visible and name not in own and name not in strings:
                missing.append(f"column {col.name}")
    return list(dict.fromkeys(missing))


def classify_failure(example: dict, final_sql: str | None, result=None) -> tuple[str, str]:
    """(label, detail) for a wrong prediction. result: the SQLResult of final_sql, run here when None."""
    if not final_sql or not final_sql.strip():
        return "generation", "no final SQL"
    tree = parse_query(final_sql)
    if tree is None:
        if bare_joins(final_sql) > MAX_BARE_JOINS:
            return "syntax", f"more than {MAX_BARE_JOINS} JOINs without ON/USING: too costly to parse"
        return "syntax", "does not parse as a single SQL query"
    missing = unknown_names(final_sql, tree, example["db_path"])
    if missing:
        return "hallucination", ", ".join(missing)
    if result is None:
        result = run_sql(example["db_path"], final_sql, timeout_s=30.0)
    if result.error is not None:
        return "syntax", result.error
    try:
        pred = extract_schema(final_sql, example["db_path"])
        gold = extract_schema(example["gold_sql"], example["db_path"])
    except (sqlglot.errors.SqlglotError, KeyError, ValueError, RecursionError) as e:  # odd but running query
        return "semantic", f"schema extraction failed: {e}"
    if pred != gold:
        diff = sorted((pred["tables"] | pred["columns"]) ^ (gold["tables"] | gold["columns"]))
        return "schema_linking", "differs from gold on " + ", ".join(diff[:8])
    return "semantic", "gold schema, different result"
