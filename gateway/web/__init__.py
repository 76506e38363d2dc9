"""The HTTP basics every floor uses: app state keys, the route table and its policy, error shapes,
the connection edge, SSE, CPU work pools. The lowest gateway floor."""
