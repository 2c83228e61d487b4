"""(public face: see the next commit)"""
