"""Statistical verification harness: proves speculative output matches plain target sampling."""
