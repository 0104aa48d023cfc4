"""Tests of the stack as shipped: demo, compose, containers, rules, alerting, dashboards, Kubernetes."""
