"""Ray placement and worker groups. The only package that imports Ray."""
