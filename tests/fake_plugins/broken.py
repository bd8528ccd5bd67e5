raise ImportError("libbroken.so: cannot open shared object file")
