"""Who may do what: API keys, authentication, rate limits, token budgets, and the usage ledger.
Imports models, link, web."""
